"""What a `ReplicaGroup` reports: the outcome of each step, each recovery, and its error."""

from __future__ import annotations

from dataclasses import dataclass


class ReplicaGroupError(RuntimeError):
    """The group cannot go on: too few replicas for too long, or replicas diverged."""


@dataclass(frozen=True)
class StepOutcome:
    """What became of one attempt at a step."""

    step: int
    committed: bool
    participants: tuple[int, ...]
    seconds: float
    reason: str = ""


@dataclass
class Recovery:
    """The life of one replacement: when its replica failed, came back and committed again."""

    replica: int
    failed_at: float
    event: str
    respawned_at: float | None = None
    healed_at: float | None = None
    first_commit_at: float | None = None
