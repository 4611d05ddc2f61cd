"""The messages of the distributed debugger: a front end (``meshvisor debug``, or
``observe.debug()`` in the client) finds the procs through their agents, asks them which calls
are paused in ``breakpoint()``, and sends pdb command lines to one of them.

Front end → agent: ListProcs; agent → front end: ProcList.
Front end → proc: DebugQuery (answered by DebugSessions) and DebugInput (answered by
DebugOutput once pdb waits for its next command, or the call goes on).
"""

from __future__ import annotations

from dataclasses import dataclass

from transport import message_type

#: The most text of pdb output one DebugOutput carries (the end of it is kept): headers are
#: at most 4 MiB.
MAX_OUTPUT_CHARS = 100_000
#: The longest command line a proc accepts.
MAX_LINE_CHARS = 10_000


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ListProcs:
    """Front end → agent: which procs run there, answered with `ProcList` to `reply_to`."""

    reply_to: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ProcList:
    """Agent → front end: its host and the (proc id, address) of each proc that is ready."""

    host: str
    procs: tuple[tuple[str, str], ...]


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class DebugQuery:
    """Front end → proc: which of its calls are paused, answered with `DebugSessions`."""

    reply_to: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class PausedCall:
    """One call paused in the debugger: where it runs and where it stopped. `where` is the
    line it stopped at as pdb shows it (``> file(line)function()`` and ``-> source``)."""

    session: int
    proc_id: str
    actor_mesh: str
    actor_class: str
    rank: int
    point: str
    host: str
    pid: int
    file: str
    line: int
    function: str
    where: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class DebugSessions:
    """Proc → front end: its paused calls (none, if nothing waits in the debugger)."""

    proc_id: str
    paused: tuple[PausedCall, ...]


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class DebugInput:
    """Front end → proc: one pdb command `line` for paused call `session`; its output goes to
    `reply_to` as a `DebugOutput`."""

    session: int
    line: str
    reply_to: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class DebugOutput:
    """Proc → front end: what pdb printed after a command. `resumed`: the call went on (it
    continued, or the session is unknown: `text` says why), so the session is over."""

    proc_id: str
    session: int
    text: str
    resumed: bool
