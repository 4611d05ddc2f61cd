"""Jobs on a cluster scheduler: host meshes from a SLURM allocation (``monarch.job``'s names).

``SlurmJob(meshes={"trainers": 4}).state().trainers`` is a `HostMesh` of 4 SLURM nodes, each
running a meshvisor host agent; see `job._slurm_job` and the README's SLURM section.
"""

from job._formats import SlurmFormatError as SlurmFormatError
from job._job_state import JobState as JobState
from job._scheduler import SlurmError as SlurmError
from job._slurm_job import SlurmJob as SlurmJob
from job._slurm_job import slurm_job as slurm_job

__all__ = ("JobState", "SlurmError", "SlurmFormatError", "SlurmJob", "slurm_job")

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
