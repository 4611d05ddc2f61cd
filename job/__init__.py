"""Jobs: named host meshes from a launcher (``monarch.job``'s names).

``SlurmJob(meshes={"trainers": 4}).state().trainers`` is a `HostMesh` of 4 SLURM nodes, each
running a meshvisor host agent (see the README's SLURM section); ``ProcessJob`` gives the same
from local agent processes, for development. Both are a `JobTrait`.

The names are imported on first use (module ``__getattr__``): the processes a job runs on its
nodes (``python -m job._batch``) import this package but need none of ``mesh``, which the
client side pulls in, so they start in a fraction of the time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: Where each public name is defined.
_HOMES = {
    "JobState": "job._job_state",
    "JobTrait": "job._job",
    "ProcessJob": "job._process_job",
    "SlurmError": "job._scheduler",
    "SlurmFormatError": "job._formats",
    "SlurmJob": "job._slurm_job",
    "slurm_job": "job._slurm_job",
}


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use (and keep it here)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    value.__module__ = __name__  # its public home, as users see it in reprs and tracebacks
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
