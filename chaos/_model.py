"""The values a chaos run is made of: targets, faults, planned faults and what was observed.

All are plain frozen dataclasses (records are filled in during the run) with ``to_dict`` /
``from_dict`` for the JSON report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

FaultKind = Literal[
    "kill", "pause", "raise", "drop", "delay", "partition", "kill_agent", "kill_client"
]
#: Every fault kind, in the order used by reports and ``--faults``.
FAULT_KINDS: tuple[FaultKind, ...] = (
    "kill",
    "pause",
    "raise",
    "drop",
    "delay",
    "partition",
    "kill_agent",
    "kill_client",
)
#: The level of target each kind of fault is aimed at.
TARGET_LEVEL: dict[str, str] = {
    "kill": "rank",
    "pause": "rank",
    "raise": "rank",
    "drop": "rank",
    "delay": "rank",
    "partition": "host",
    "kill_agent": "host",
    "kill_client": "client",
}
TargetLevel = Literal["rank", "host", "client"]


@dataclass(frozen=True, order=True)
class Target:
    """What a fault is aimed at: a rank of an actor mesh, a host of the allocation, or the
    client. Ranks are flat indices into the mesh (row-major over its extent)."""

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

    def __str__(self) -> str:
        if self.level == "rank":
            return f"rank {self.rank} of mesh {self.mesh!r}"
        if self.level == "host":
            return f"host {self.host}"
        return "the client"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Target:
        return cls(**data)


@dataclass(frozen=True)
class Fault:
    """One fault to inject. Build with the class methods, e.g. ``Fault.kill("SIGSEGV")``."""

    kind: FaultKind
    signal: str | None = None  # kill: the signal's name
    exit_code: int | None = None  # kill: exit with this code instead of a signal
    duration_s: float = 0.0  # pause, drop, delay, partition: how long it lasts
    probability: float = 0.0  # drop: chance that each message is dropped
    delay_ms: float = 0.0  # delay: added to each message
    endpoint: str | None = None  # raise: the endpoint that raises (None: any endpoint)
    fatal: bool = True  # raise: a BaseException that fails the actor, or a plain Exception

    @classmethod
    def kill(cls, signal: str = "SIGKILL") -> Fault:
        return cls("kill", signal=signal)

    @classmethod
    def exit(cls, code: int) -> Fault:
        return cls("kill", exit_code=code)

    @classmethod
    def pause(cls, duration_s: float) -> Fault:
        return cls("pause", duration_s=duration_s)

    @classmethod
    def raise_in(cls, endpoint: str | None = None, *, fatal: bool = True) -> Fault:
        return cls("raise", endpoint=endpoint, fatal=fatal)

    @classmethod
    def drop(cls, probability: float, duration_s: float) -> Fault:
        return cls("drop", probability=probability, duration_s=duration_s)

    @classmethod
    def delay(cls, delay_ms: float, duration_s: float) -> Fault:
        return cls("delay", delay_ms=delay_ms, duration_s=duration_s)

    @classmethod
    def partition(cls, duration_s: float) -> Fault:
        return cls("partition", duration_s=duration_s)

    @classmethod
    def kill_agent(cls) -> Fault:
        return cls("kill_agent")

    @classmethod
    def kill_client(cls) -> Fault:
        return cls("kill_client")

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {', '.join(FAULT_KINDS)}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"a drop probability must be within [0, 1], not {self.probability}")
        if self.duration_s < 0 or self.delay_ms < 0:
            raise ValueError("fault durations and delays cannot be negative")

    def describe(self) -> str:
        """A short human description, e.g. ``kill SIGKILL`` or ``pause 1.5 s``."""
        if self.kind == "kill":
            return f"exit {self.exit_code}" if self.exit_code is not None else f"kill {self.signal}"
        if self.kind == "pause":
            return f"pause {self.duration_s:g} s"
        if self.kind == "raise":
            where = self.endpoint or "any endpoint"
            return f"raise in {where}" + ("" if self.fatal else " (non-fatal)")
        if self.kind == "drop":
            return f"drop {self.probability:.0%} for {self.duration_s:g} s"
        if self.kind == "delay":
            return f"delay {self.delay_ms:g} ms for {self.duration_s:g} s"
        if self.kind == "partition":
            return f"partition {self.duration_s:g} s"
        return self.kind.replace("_", " ")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fault:
        return cls(**data)


@dataclass(frozen=True, order=True)
class PlannedFault:
    """A fault with its target and its time, in seconds after the run started."""

    at_s: float
    fault: Fault = field(compare=False)
    target: Target = field(compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"at_s": self.at_s, "fault": self.fault.to_dict(), "target": self.target.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlannedFault:
        return cls(data["at_s"], Fault.from_dict(data["fault"]), Target.from_dict(data["target"]))


@dataclass(frozen=True)
class ObservedEvent:
    """A supervision event as the client's owner saw it, `at_s` seconds after the start."""

    at_s: float
    kind: str
    mesh: str | None
    rank: int | None
    host: int | None
    pid: int | None
    message: str
    fault: int | None = None  # index of the fault it was attributed to

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ObservedEvent:
        return cls(**data)


Verdict = Literal["ok", "missed", "wrong_kind", "not_healed", "not_injected"]


@dataclass
class FaultRecord:
    """What happened to one planned fault: when it was injected, seen and healed."""

    index: int
    planned: PlannedFault
    expected: tuple[str, ...]  # event kinds that count as observing it; () = none expected
    injected_at_s: float | None = None
    detected_at_s: float | None = None  # the first attributed event
    healthy_at_s: float | None = None  # the target answered again
    observed: list[str] = field(default_factory=list)  # kinds of the attributed events
    verdict: Verdict = "not_injected"
    note: str = ""

    @property
    def detect_s(self) -> float | None:
        if self.injected_at_s is None or self.detected_at_s is None:
            return None
        return self.detected_at_s - self.injected_at_s

    @property
    def recover_s(self) -> float | None:
        if self.injected_at_s is None or self.healthy_at_s is None:
            return None
        return self.healthy_at_s - self.injected_at_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "at_s": self.planned.at_s,
            "fault": self.planned.fault.to_dict(),
            "description": self.planned.fault.describe(),
            "target": self.planned.target.to_dict(),
            "target_description": str(self.planned.target),
            "expected_events": list(self.expected),
            "observed_events": list(self.observed),
            "injected_at_s": self.injected_at_s,
            "detected_at_s": self.detected_at_s,
            "healthy_at_s": self.healthy_at_s,
            "detect_s": self.detect_s,
            "recover_s": self.recover_s,
            "verdict": self.verdict,
            "note": self.note,
        }


@dataclass(frozen=True)
class InvariantResult:
    """The verdict of one invariant."""

    name: str
    held: bool
    detail: str = ""
    builtin: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InvariantResult:
        return cls(**data)


@dataclass(frozen=True)
class TargetSet:
    """Everything a schedule may aim at: the ranks of the registered actor meshes (name and
    size), the hosts of the allocation and the client. Its order is fixed, so that the same
    workload gives the same candidates in the same order."""

    meshes: tuple[tuple[str, int], ...]
    hosts: int
    client: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "meshes", tuple(sorted(self.meshes)))

    def candidates(self, level: str) -> list[Target]:
        """Every target of `level` ("rank", "host" or "client"), in a fixed order."""
        if level == "rank":
            return [Target.of_rank(name, r) for name, size in self.meshes for r in range(size)]
        if level == "host":
            return [Target.of_host(h) for h in range(self.hosts)]
        return [Target.client()] if self.client else []

    def __contains__(self, target: object) -> bool:
        return isinstance(target, Target) and target in self.candidates(target.level)

    def to_dict(self) -> dict[str, Any]:
        return {
            "meshes": {name: size for name, size in self.meshes},
            "hosts": self.hosts,
            "client": self.client,
        }
