"""The messages of proc output and log settings (`ProcMesh.logging_option`): owners ask agents
to forward their procs' lines, agents forward them, procs take a log level."""

from __future__ import annotations

from dataclasses import dataclass

from transport import message_type


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class SyncOutput:
    """Owner → agent: the fork server reads what `proc_ids` printed so far, then forwards
    their lines to their owner (`forward`), or relays them nowhere but the log files
    (`quiet`), or to its own output, then answers `reply_to` with `OutputSynced(token)`,
    after every line read before."""

    proc_ids: tuple[str, ...]
    forward: bool
    reply_to: str
    token: str
    quiet: bool = False


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class OutputSynced:
    """Agent → owner: the `SyncOutput` of `token` is done; its lines came before this."""

    token: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ProcOutput:
    """Agent → owner: complete lines proc `proc_id` wrote to `stream` (1 stdout, 2 stderr);
    `source` names it (its mesh and point)."""

    proc_id: str
    source: str
    stream: int
    lines: tuple[str, ...]


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class SetProcLogLevel:
    """Owner → proc: the level of the proc's root `logging` logger."""

    level: int
