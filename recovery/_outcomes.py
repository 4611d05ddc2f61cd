"""What a `ReplicaGroup` reports: the outcome of each step, each recovery, and its error."""

from __future__ import annotations

from dataclasses import dataclass

from supervision import ActorError


class ReplicaGroupError(RuntimeError):
    """The group cannot go on: too few replicas for too long, or replicas diverged."""


class ReplicaLost(RuntimeError):
    """A call of a step not made: its replica failed earlier in the step (and is being
    replaced: the call would wait for the replacement)."""


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
    by_spare: bool = False  # a spare took the replica's place (no re-spawn, no full heal)
    in_flight: bool = False  # the replacement joined a step in flight (`InFlight.join`)


def alive(error: BaseException) -> bool:
    """Whether a replica whose call raised `error` is still there (its endpoint raised)."""
    return isinstance(error, (ActorError, TimeoutError))


def short(error: BaseException) -> str:
    """The first line of `error` with its type, for a reason or a log line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


class ExchangeAborted(RuntimeError):
    """A collective was given up: a peer of the group failed (supervision said so), or the
    process is exiting."""
