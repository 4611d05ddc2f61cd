"""`JobState`: what a running job gives, its host meshes by name and the hosts behind them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mesh import HostMesh


@dataclass(frozen=True)
class JobState:
    """A running job's host meshes by name (``state.trainers`` or ``state["trainers"]``) and
    the hosts behind each of them (SLURM node names; a `ProcessJob`'s host keys), and the
    address of each host's agent."""

    job_id: str
    meshes: Mapping[str, HostMesh]
    nodes: Mapping[str, tuple[str, ...]]
    restarts: int = 0  # a SLURM job's requeue count of the run these agents belong to
    addresses: Mapping[str, str] = field(default_factory=dict)  # host: its agent's address

    def __getattr__(self, name: str) -> HostMesh:
        meshes: Mapping[str, HostMesh] = self.__dict__.get("meshes", {})
        if name in meshes:
            return meshes[name]
        raise AttributeError(f"job {self.__dict__.get('job_id')} has no mesh {name!r}")

    def __getitem__(self, name: str) -> HostMesh:
        mesh: HostMesh = getattr(self, name)
        return mesh
