"""The values a chaos run is made of: planned faults, what was observed, and the verdicts.

All are plain dataclasses (frozen, except the records filled in during the run) with
``to_dict`` / ``from_dict`` for the JSON report. Faults are in `_faults`, targets in `_targets`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from ._faults import Fault
from ._targets import Target


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
    evidence: str = ""  # its root cause's evidence, trimmed: a stack, where memory ran out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ObservedEvent:
        return cls(**data)


Verdict = Literal["ok", "missed", "wrong_kind", "not_healed", "not_injected"]
#: Every verdict a fault record can have.
VERDICTS: tuple[Verdict, ...] = ("ok", "missed", "wrong_kind", "not_healed", "not_injected")


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
