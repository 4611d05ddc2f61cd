"""`JobTrait`: what every job gives, whatever starts its hosts (``monarch.job.JobTrait``'s name).

A job is a specification of named host meshes. ``apply()`` makes it real (submits it, starts
its hosts), ``state()`` waits until every host answers and gives its `HostMesh` per name, and
``kill()`` ends it with everything that runs on it. A job is also a context manager: entering
applies it and leaving kills it, unless the job is persistent.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TypeVar

from job._job_state import JobState

J = TypeVar("J", bound="JobTrait")


class JobTrait(ABC):
    """Named host meshes from some launcher: a scheduler (`SlurmJob`), local processes
    (`ProcessJob`), or hosts started another way."""

    #: A persistent job outlives the client that made it; leaving its ``with`` block keeps it.
    persistent: bool = False

    @abstractmethod
    def apply(self: J) -> J:
        """Create the job if it does not exist yet (later calls do nothing); returns itself."""

    @abstractmethod
    def state(
        self, timeout_s: float | None = None, *, cached_path: str | os.PathLike[str] | None = None
    ) -> JobState:
        """The job's host meshes by name, applying it first if needed, once every host answers
        (bounded by `timeout_s`; TimeoutError naming what did not come up). With `cached_path`
        a job that outlives its client is reused by the next run (see `SlurmJob.state`)."""

    @abstractmethod
    def kill(self) -> None:
        """End the job: its hosts stop, and every proc on them."""

    def __enter__(self: J) -> J:
        return self.apply()

    def __exit__(self, *exc: object) -> None:
        if not self.persistent:
            self.kill()


def check_meshes(meshes: Mapping[str, int]) -> None:
    """ValueError naming the problem unless `meshes` maps identifiers to positive counts."""
    if not meshes:
        raise ValueError("a job needs at least one mesh, e.g. meshes={'trainers': 2}")
    for mesh_name, count in meshes.items():
        if not isinstance(mesh_name, str) or not mesh_name.isidentifier():
            raise ValueError(f"mesh name {mesh_name!r} must be a Python identifier")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"mesh {mesh_name!r} needs a positive number of hosts, not {count!r}")
