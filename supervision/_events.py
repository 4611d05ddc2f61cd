"""`SupervisionEvent`: the immutable record of one failure travelling up the supervision tree.

One kind is a warning, not a failure: ``"preempting"`` says that the proc's host is about to be
taken away (SLURM's notice ahead of a preemption or of the job's time limit), `time_left_s`
how long it has. Its owner's handlers hear it so that they can drain; unhandled, it is logged
(the root prints it) and nothing fails until the kill that may follow.

``"stuck"``: a call of an endpoint ran past its limit (``call_limit_s``, the call watchdog: a
deadlock that heartbeats cannot see); `traceback` is the stack where the call waits. The actor
failed and its owner stops its proc, as a hung one's."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ._evidence import trim_evidence

EventKind = Literal[
    "exception",
    "exit",
    "signal",
    "hung",
    "stuck",
    "unreachable",
    "spawn_failed",
    "escalated",
    "stopped",
    "preempting",
    "oom",
]
EVENT_KINDS: tuple[str, ...] = get_args(EventKind)
#: How many lines of evidence (a traceback, a stack dump) a report shows at most.
REPORT_EVIDENCE_LINES = 30
#: Kinds that warn of what is coming rather than report a failure: unhandled, nothing fails.
NOTICE_KINDS: tuple[str, ...] = ("preempting",)


@dataclass(frozen=True)
class SupervisionEvent:
    """What failed, where and why. `cause` is the child's event when this one is an escalation;
    `time_left_s` is the time a ``"preempting"`` notice gives (None when not known)."""

    kind: EventKind
    mesh_name: str
    rank: Mapping[str, int] | None = None
    actor_id: str | None = None
    proc_id: str | None = None
    host: str | None = None
    pid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    message: str = ""
    traceback: str | None = None
    time: float = field(default_factory=time.time)
    cause: SupervisionEvent | None = None
    time_left_s: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(
                f"unknown supervision event kind {self.kind!r}; "
                f"expected one of {', '.join(EVENT_KINDS)}"
            )

    def __str__(self) -> str:
        return f"{self._subject()} {self._reason()}"

    def _subject(self) -> str:
        where = f'mesh "{self.mesh_name}"'
        if self.rank is not None:
            where = f"rank {dict(self.rank)} of {where}"
        if self.pid is not None:
            where = f"process {self.pid} running {where}"
        if self.host:
            where += f" on host {self.host}"
        return where[0].upper() + where[1:]

    def _reason(self) -> str:
        detail = f": {self.message}" if self.message else ""
        if self.kind == "signal":
            return f"was killed by {self.signal}{detail}."
        if self.kind == "exit":
            return f"exited with code {self.exit_code} without being asked to stop{detail}."
        if self.kind == "oom":
            return f"ran out of memory and was killed{detail}."
        if self.kind == "hung":
            return f"stopped answering heartbeats and is considered hung{detail}."
        if self.kind == "stuck":
            return f"is stuck: a call ran past its time limit (call_limit_s){detail}."
        if self.kind == "unreachable":
            return f"became unreachable{detail}."
        if self.kind == "spawn_failed":
            return f"could not be spawned{detail}."
        if self.kind == "escalated":
            return f"failed because a child failure was not handled{detail}."
        if self.kind == "preempting":
            left = "" if self.time_left_s is None else f", {self.time_left_s:g} s left"
            return f"is about to be preempted or reach its time limit{left}{detail}."
        if self.kind == "stopped":
            return f"was stopped {self.message}." if self.message else "was stopped."
        return f"failed with an exception{detail}."

    @property
    def is_notice(self) -> bool:
        """Whether this warns of what is coming (``"preempting"``) rather than reports a failure."""
        return self.kind in NOTICE_KINDS

    def root_cause(self) -> SupervisionEvent:
        """The deepest event of the escalation chain."""
        event = self
        while event.cause is not None:
            event = event.cause
        return event

    def report(self, max_lines: int = REPORT_EVIDENCE_LINES) -> str:
        """A readable account that fits a screen: the root cause first (what, where, why),
        its evidence trimmed to `max_lines` (a stack dump's most relevant thread first), then
        the path up the tree."""
        chain = [self]
        while chain[-1].cause is not None:
            chain.append(chain[-1].cause)  # type: ignore[arg-type]
        root = chain[-1]
        lines = ["Supervision report", "==================", f"Root cause: {root}"]
        lines.append(f"  {root._facts()}")
        if root.traceback:
            lines += ["", f"{root._evidence_title()}:", *root.evidence(max_lines)]
        if len(chain) > 1:
            lines += ["", "Propagated up the tree:"]
            lines += [f"  {i}. {event}" for i, event in enumerate(reversed(chain[:-1]), 1)]
        return "\n".join(lines)

    def evidence(self, max_lines: int = REPORT_EVIDENCE_LINES) -> list[str]:
        """The lines of this event's traceback that fit in `max_lines` (plus a line saying
        what was left out): an exception's end, a stack dump's most relevant thread."""
        return trim_evidence(self.traceback or "", max_lines) if self.traceback else []

    def _facts(self) -> str:
        """The fields of the event on one line: kind, mesh, rank, proc, pid, host, signal."""
        facts = [f"kind: {self.kind}", f"mesh: {self.mesh_name}"]
        if self.rank is not None:
            facts.append(f"rank: {dict(self.rank)}")
        named = (("proc", self.proc_id), ("pid", self.pid), ("host", self.host))
        facts += [f"{name}: {value}" for name, value in named if value is not None]
        if self.signal or self.exit_code is not None:
            facts.append(
                f"signal: {self.signal}" if self.signal else f"exit code: {self.exit_code}"
            )
        return " | ".join(facts)

    def _evidence_title(self) -> str:
        if (self.traceback or "").lstrip().startswith("Traceback"):
            return "Remote traceback (innermost call last)"
        if self.kind == "oom":
            return "Where it ran out of memory"
        return "Python stacks of its threads (the most relevant first)"

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, for structured logs and JSON reports."""
        data = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "cause"}
        data["rank"] = dict(self.rank) if self.rank is not None else None
        data["cause"] = self.cause.to_dict() if self.cause is not None else None
        return data
