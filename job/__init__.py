"""Jobs: named host meshes from a launcher (``monarch.job``'s names).

``SlurmJob(meshes={"trainers": 4}).state().trainers`` is a `HostMesh` of 4 SLURM nodes, each
running a meshvisor host agent (see the README's SLURM section); ``ProcessJob`` gives the same
from local agent processes, for development. Both are a `JobTrait`.
"""

from job._formats import SlurmFormatError as SlurmFormatError
from job._job import JobTrait as JobTrait
from job._job_state import JobState as JobState
from job._process_job import ProcessJob as ProcessJob
from job._scheduler import SlurmError as SlurmError
from job._slurm_job import SlurmJob as SlurmJob
from job._slurm_job import slurm_job as slurm_job

__all__ = (
    "JobState",
    "JobTrait",
    "ProcessJob",
    "SlurmError",
    "SlurmFormatError",
    "SlurmJob",
    "slurm_job",
)

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
