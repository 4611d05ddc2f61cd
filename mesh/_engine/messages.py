"""The closed set of messages meshvisor processes exchange. Payloads travel beside them.

Owner → agent: SpawnProcs, StopProcs, ShutdownAgent, WatchProcs.
Agent → owner (and watchers): ProcExited, SpawnFailed.   Proc → agent: Heartbeat.
Agent → owner: PreemptionNotice (the host goes away soon).
Proc → owner: ProcReady, ActorFailed, ReplyLost (an answer could not reach its caller).
Caller → proc: SpawnActor, CallActor, StopActor, StopProc.
Proc → caller: Reply (payload: the value) and Failure (payload: the error).
Caller → procs it called: InboxClosed (a reply inbox is gone: drop the connection to it).
Caller → a proc: Relay (payload: a function whose Future answers the call, as a Reply or a
Failure of kind "raised" whose payload is the exception).
Any process → a port's receiver: PortMessage (payload: the value), PortHeld (a new holder).
A port's receiver → its holders: ReceiverAddresses (it listens on tcp now).
Proc output and log settings (SyncOutput, ProcOutput, ...) are in `log_messages`; the live
view's snapshots (SnapshotQuery, HostSnapshot, ProcActors) in `view_messages`.

Long because the wire contract is one closed set, reviewed together: every message, and the
checks of what a peer sent against the types each declares.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from mesh._engine.field_checks import invalid_fields as invalid_fields
from mesh._engine.field_checks import short_repr as _short
from transport import FaultRule, binary_header, is_address, message_type


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ProcSpec:
    """What an agent needs to start one proc (a point of a proc mesh)."""

    proc_id: str
    mesh_name: str
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    rank: int
    replaces: str = ""  # a re-spawn: the proc this one replaces (its watchers move over)


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class SpawnProcs:
    owner: str
    procs: tuple[ProcSpec, ...]
    env: tuple[tuple[str, str], ...]
    sys_path: tuple[str, ...]
    cwd: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    busy_timeout_s: float = 60.0
    bootstrap: tuple[str, ...] = ()  # (program, argv0, *args): launch, not fork; see bootstrap
    forward_output: bool = False  # lines to the owner (`ProcOutput`), not the agent's output
    setup: bytes = b""  # a pickled function each proc runs before it is ready (the agent never
    # unpickles it): spawn_procs(bootstrap=...)
    memory_limit: int = 0  # bytes of private memory each proc may use (0: no limit)
    quiet_output: bool = False  # not forwarded: lines only in the log files, not the output


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class StopProcs:
    """Owner → agent. `reply_to` hears of procs the agent no longer knows (they ended before,
    or with a previous agent), so that a stop never waits for an exit report that cannot come.
    `why`: a reason the procs' watchers are told with their exit (a stuck actor), else ""."""

    proc_ids: tuple[str, ...]
    grace_s: float
    reply_to: str | None = None
    why: str = ""


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ShutdownAgent:
    grace_s: float


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ProcReady:
    proc_id: str
    address: str
    pid: int
    host: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ProcExited:
    """Agent → owner and watchers. `hung`: the agent killed it for missing heartbeats, and
    `why_hung` says how it told a hang from a busy proc. `traceback`: the Python stacks it
    dumped (hung, or a fatal signal); `out_of_memory`: why it ran out of memory, with figures."""

    proc_id: str
    pid: int
    host: str
    exit_code: int | None
    signal: str | None
    requested: bool
    hung: bool = False
    why_hung: str = ""
    traceback: str = ""
    out_of_memory: str = ""
    why_stopped: str = ""  # `StopProcs.why`


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class SpawnFailed:
    proc_id: str
    host: str
    reason: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class SpawnActor:
    """Build one actor of mesh `actor_id` on the receiving proc. Payload: (cls, args, kwargs).
    `call_limit_s`: the call watchdog's limit from the spawner's settings (None: none)."""

    actor_id: str
    owner: str
    mesh_name: str
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    rank: int
    restart_count: int = 0
    call_limit_s: float | None = None


@binary_header(b"C")
@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class CallActor:
    """Run `endpoint` on actor `actor_id`. Payload: (args, kwargs). `reply_to` None: no reply.

    `labels`, `sizes` and `rank` give the recipient's point in the mesh the call was sent to.
    """

    call_id: int
    reply_to: str | None
    actor_id: str
    endpoint: str
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    rank: int


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class StopActor:
    """Stop actor `actor_id` after the messages already queued for it; ack to `reply_to`."""

    call_id: int
    reply_to: str | None
    actor_id: str
    rank: int


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class StopProc:
    pass


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class SetFaultRules:
    """Chaos testing: add fault rules to the receiving process's sends, or clear them all."""

    rules: tuple[FaultRule, ...]
    clear: bool = False


@binary_header(b"R")
@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class Reply:
    call_id: int
    rank: int


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class Failure:
    """A call did not produce a value. `kind` is "exception" (the actor lives on), "raised" (a
    relay's error, the payload being the exception itself) or the reason the actor cannot serve
    it ("failed", "stopped", "unknown"). Payload: the error object."""

    call_id: int
    rank: int
    kind: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ActorFailed:
    """Proc → owner: an actor failed (constructor raised, broadcast raised, BaseException).
    Payload: the SupervisionEvent."""

    actor_id: str
    rank: int


#: A `ReplyLost`'s call id and rank for every call made at its `reply_to` that waits on its
#: proc (more answers were refused than the proc keeps one by one: `HandshakeWaits`).
EVERY_CALL = -1


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ReplyLost:
    """Proc → the owner of an actor: the answer to call `call_id` (its recipient `rank`)
    could not be sent to `reply_to` (`reason`: unreachable, or not authenticated). The owner
    ends that call with an error if it made it, else sends the caller a `Failure` with the
    payload (the "unreachable" SupervisionEvent), so that the caller does not wait forever."""

    call_id: int
    rank: int
    reply_to: str
    proc_id: str
    endpoint: str
    reason: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class Wake:
    """To a reply inbox: a call of its thread was settled elsewhere; look at it again. To a
    process's inbox: its reader runs what other threads asked of it (`reader_calls.py`)."""


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class InboxClosed:
    """Caller → the procs it called from a thread that has ended: its reply inbox at
    `address` is closed, so they drop their connection to it (two descriptors each)."""

    address: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class Heartbeat:
    """Proc → its agent, every heartbeat interval, from a thread that needs the GIL."""

    proc_id: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class WatchProcs:
    """To an agent: also tell `watcher` when any of these procs exits (callers that do not own
    them). Procs already gone are reported at once."""

    proc_ids: tuple[str, ...]
    watcher: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class OwnerAlive:
    """Owner → agent, periodically, from clients that attached over the network: the agent
    stops the owner's procs if these stop coming for longer than its orphan timeout."""

    owner: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class AgentAlive:
    """Agent → a network owner, in answer to OwnerAlive: the owner declares the agent's procs
    unreachable when these stop coming (a lost host, a cut link), or when `incarnation`
    changes (the agent was restarted at the same address: its old procs died with it)."""

    agent: str
    incarnation: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ProcReplaced:
    """Agent → watchers of a proc that was re-spawned: the same rank now lives here."""

    old_proc_id: str
    proc_id: str
    address: str
    pid: int
    host: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class PreemptionNotice:
    """Agent → the owner of `proc_ids`: the agent got the notice signal `signal` (its host is
    about to be preempted or reach its time limit); `time_left_s` is None when not known."""

    proc_ids: tuple[str, ...]
    host: str
    signal: str
    time_left_s: float | None = None


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class Relay:
    """Run a function in the receiving proc's runtime (not in an actor) and answer the call
    with the outcome of the Future it returns: partial reductions of a mesh call's answers.
    Payload: (function, args); it is called as ``function(rank, *args)``."""

    call_id: int
    reply_to: str
    rank: int


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class PortMessage:
    """To the process of a port's receiver: one message for port `port_id`. `kind` is "value"
    or "exception"; payload: the value or the exception. `rank`: the sender's, -1 if none."""

    port_id: int
    rank: int
    kind: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class PortHeld:
    """To the process of a port's receiver: proc `proc_id` (at `address`, run by agent
    `agent`) now holds a copy of the port, so the receiver can tell when every sender is gone."""

    port_id: int
    proc_id: str
    agent: str
    address: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ReceiverAddresses:
    """To a holder of ports whose receiver is process `proc_id`: that process listens at
    `ipc` and `tcp` now ("": none), since it began to listen on tcp after the holder got a
    port; a port passed on from the holder carries them, so it reaches the receiver from
    another host."""

    proc_id: str
    ipc: str
    tcp: str


# -- validation of what a peer sent ------------------------------------------------------------

#: What a proc id may look like: it names socket files in a run directory, so no separators,
#: nothing hidden, and short enough for a unix socket path.
PROC_ID_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


def invalid_request(header: object) -> str | None:
    """Why an agent must refuse `header`: wrongly typed fields or values it cannot act on."""
    reason = invalid_fields(header)
    if reason is not None:
        return reason
    check = _VALUE_CHECKS.get(type(header))
    return check(header) if check is not None else None


def refusable_spawn(header: object) -> tuple[str, tuple[str, ...]] | None:
    """(owner, proc ids) of a refused SpawnProcs when they can be told so, else None."""
    if type(header) is not SpawnProcs or _bad_address("", header.owner) is not None:
        return None
    procs = header.procs
    if type(procs) is not tuple or not all(type(p) is ProcSpec for p in procs):
        return None
    ids = tuple(p.proc_id for p in procs)
    if not all(type(i) is str for i in ids):
        return None
    return header.owner, ids


def _bad_address(what: str, address: str | None) -> str | None:
    if address is None or is_address(address):
        return None
    return f"{what} {_short(address)} is not a meshvisor address (ipc://PATH or tcp://HOST:PORT)"


def _bad_duration(what: str, seconds: float, *, positive: bool = False) -> str | None:
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        sign = "positive" if positive else "non-negative"
        return f"{what} must be a finite, {sign} number of seconds, not {seconds!r}"
    return None


def _bad_proc_id(proc_id: str) -> str | None:
    if PROC_ID_PATTERN.fullmatch(proc_id) is None:
        return (
            f"proc id {_short(proc_id)} is not 1 to 100 letters, digits, '_', '.' or '-' "
            "(not starting with '.' or '-': it names socket files)"
        )
    return None


def _bad_spec(spec: ProcSpec) -> str | None:
    if len(spec.labels) != len(spec.sizes) or any(size < 1 for size in spec.sizes):
        return f"proc {_short(spec.proc_id)}: labels {spec.labels!r} and sizes {spec.sizes!r}"
    if not 0 <= spec.rank < math.prod(spec.sizes):
        return f"proc {_short(spec.proc_id)}: rank {spec.rank} is outside sizes {spec.sizes!r}"
    if "\0" in spec.mesh_name or len(spec.mesh_name) > 1000:
        return f"proc {_short(spec.proc_id)}: mesh name {_short(spec.mesh_name)} is not valid"
    return _bad_proc_id(spec.proc_id) or (_bad_proc_id(spec.replaces) if spec.replaces else None)


def _bad_spawn(request: SpawnProcs) -> str | None:
    texts = (request.cwd, *request.sys_path, *(item for pair in request.env for item in pair))
    if any("\0" in text for text in texts) or any(not key or "=" in key for key, _ in request.env):
        return "env, sys_path and cwd must hold no NUL characters, env names no '='"
    if request.heartbeat_timeout_s <= request.heartbeat_interval_s:
        return "heartbeat_timeout_s must be longer than heartbeat_interval_s"
    return (
        _bad_address("owner", request.owner)
        or _bad_duration("heartbeat_interval_s", request.heartbeat_interval_s, positive=True)
        or _bad_duration("heartbeat_timeout_s", request.heartbeat_timeout_s, positive=True)
        or _bad_duration("busy_timeout_s", request.busy_timeout_s, positive=True)
        or ("memory_limit must not be negative" if request.memory_limit < 0 else None)
        or next(filter(None, map(_bad_spec, request.procs)), None)
    )


_VALUE_CHECKS: dict[type, Any] = {
    SpawnProcs: _bad_spawn,
    StopProcs: lambda h: (
        _bad_duration("grace_s", h.grace_s) or _bad_address("reply_to", h.reply_to)
    ),
    ShutdownAgent: lambda h: _bad_duration("grace_s", h.grace_s),
    WatchProcs: lambda h: _bad_address("watcher", h.watcher),
    OwnerAlive: lambda h: _bad_address("owner", h.owner),
    ProcReady: lambda h: _bad_address("address", h.address),
    ReplyLost: lambda h: _bad_address("reply_to", h.reply_to) or _bad_proc_id(h.proc_id),
    ReceiverAddresses: lambda h: (
        _bad_address("ipc", h.ipc or None) or _bad_address("tcp", h.tcp or None)
    ),
}
