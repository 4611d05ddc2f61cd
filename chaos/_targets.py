"""What a fault may be aimed at: a `Target` (a rank of an actor mesh, a host, the client, or
the whole SLURM job), and the `TargetSet` a schedule plans against."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

#: The levels of target: a rank of an actor mesh, a host of the allocation, the client, the
#: SLURM job of the allocation (a run on SLURM only).
TargetLevel = Literal["rank", "host", "client", "job"]
#: Every level of target, in a fixed order.
TARGET_LEVELS: tuple[TargetLevel, ...] = ("rank", "host", "client", "job")


@dataclass(frozen=True, order=True)
class Target:
    """What a fault is aimed at: a rank of an actor mesh, a host of the allocation, the
    client, or the allocation's SLURM job. Ranks are flat indices into the mesh (row-major
    over its extent)."""

    level: TargetLevel
    mesh: str | None = None
    rank: int | None = None
    host: int | None = None

    @classmethod
    def of_rank(cls, mesh: str, rank: int) -> Target:
        return cls("rank", mesh=mesh, rank=rank)

    @classmethod
    def of_host(cls, host: int) -> Target:
        return cls("host", host=host)

    @classmethod
    def client(cls) -> Target:
        return cls("client")

    @classmethod
    def job(cls) -> Target:
        return cls("job")

    def __str__(self) -> str:
        if self.level == "rank":
            return f"rank {self.rank} of mesh {self.mesh!r}"
        if self.level == "host":
            return f"host {self.host}"
        return "the job" if self.level == "job" else "the client"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Target:
        return cls(**data)


@dataclass(frozen=True)
class TargetSet:
    """Everything a schedule may aim at: the ranks of the registered actor meshes (name and
    size), the hosts of the allocation, the client, and the SLURM job when the allocation is
    one (`job`). Its order is fixed, so that the same
    workload gives the same candidates in the same order."""

    meshes: tuple[tuple[str, int], ...]
    hosts: int
    client: bool = True
    job: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "meshes", tuple(sorted(self.meshes)))

    def candidates(self, level: str) -> list[Target]:
        """Every target of `level` ("rank", "host", "client" or "job"), in a fixed order."""
        if level == "rank":
            return [Target.of_rank(name, r) for name, size in self.meshes for r in range(size)]
        if level == "host":
            return [Target.of_host(h) for h in range(self.hosts)]
        if level == "job":
            return [Target.job()] if self.job else []
        return [Target.client()] if self.client else []

    def __contains__(self, target: object) -> bool:
        return isinstance(target, Target) and target in self.candidates(target.level)

    def to_dict(self) -> dict[str, Any]:
        return {
            "meshes": {name: size for name, size in self.meshes},
            "hosts": self.hosts,
            "client": self.client,
            "job": self.job,
        }
