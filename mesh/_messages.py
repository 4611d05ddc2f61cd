"""The closed set of messages meshvisor processes exchange. Payloads travel beside them.

Owner → agent: SpawnProcs, StopProcs, ShutdownAgent, WatchProcs.
Agent → owner (and watchers): ProcExited, SpawnFailed.   Proc → agent: Heartbeat.
Proc → owner: ProcReady, ActorFailed.   Caller → proc: SpawnActor, CallActor, StopActor, StopProc.
Proc → caller: Reply (payload: the value) and Failure (payload: the error).
Caller → procs it called: InboxClosed (a reply inbox is gone: drop the connection to it).
"""

from __future__ import annotations

from dataclasses import dataclass

from transport import FaultRule, message_type


@message_type
@dataclass(frozen=True, slots=True)
class ProcSpec:
    """What an agent needs to start one proc (a point of a proc mesh)."""

    proc_id: str
    mesh_name: str
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    rank: int
    replaces: str = ""  # a re-spawn: the proc this one replaces (its watchers move over)


@message_type
@dataclass(frozen=True, slots=True)
class SpawnProcs:
    owner: str
    procs: tuple[ProcSpec, ...]
    env: tuple[tuple[str, str], ...]
    sys_path: tuple[str, ...]
    cwd: str
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    busy_timeout_s: float = 60.0


@message_type
@dataclass(frozen=True, slots=True)
class StopProcs:
    """Owner → agent. `reply_to` hears of procs the agent no longer knows (they ended before,
    or with a previous agent), so that a stop never waits for an exit report that cannot come."""

    proc_ids: tuple[str, ...]
    grace_s: float
    reply_to: str | None = None


@message_type
@dataclass(frozen=True, slots=True)
class ShutdownAgent:
    grace_s: float


@message_type
@dataclass(frozen=True, slots=True)
class ProcReady:
    proc_id: str
    address: str
    pid: int
    host: str


@message_type
@dataclass(frozen=True, slots=True)
class ProcExited:
    """Agent → owner and watchers. `hung`: the agent killed it for missing heartbeats, and
    `why_hung` says how it told a hang from a busy proc."""

    proc_id: str
    pid: int
    host: str
    exit_code: int | None
    signal: str | None
    requested: bool
    hung: bool = False
    why_hung: str = ""


@message_type
@dataclass(frozen=True, slots=True)
class SpawnFailed:
    proc_id: str
    host: str
    reason: str


@message_type
@dataclass(frozen=True, slots=True)
class SpawnActor:
    """Build one actor of mesh `actor_id` on the receiving proc. Payload: (cls, args, kwargs)."""

    actor_id: str
    owner: str
    mesh_name: str
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    rank: int
    restart_count: int = 0


@message_type
@dataclass(frozen=True, slots=True)
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
@dataclass(frozen=True, slots=True)
class StopActor:
    """Stop actor `actor_id` after the messages already queued for it; ack to `reply_to`."""

    call_id: int
    reply_to: str | None
    actor_id: str
    rank: int


@message_type
@dataclass(frozen=True, slots=True)
class StopProc:
    pass


@message_type
@dataclass(frozen=True, slots=True)
class SetFaultRules:
    """Chaos testing: add fault rules to the receiving process's sends, or clear them all."""

    rules: tuple[FaultRule, ...]
    clear: bool = False


@message_type
@dataclass(frozen=True, slots=True)
class Reply:
    call_id: int
    rank: int


@message_type
@dataclass(frozen=True, slots=True)
class Failure:
    """A call did not produce a value. `kind` is "exception" (the actor lives on) or the reason
    the actor cannot serve it ("failed", "stopped", "unknown"). Payload: the error object."""

    call_id: int
    rank: int
    kind: str


@message_type
@dataclass(frozen=True, slots=True)
class ActorFailed:
    """Proc → owner: an actor failed (constructor raised, broadcast raised, BaseException).
    Payload: the SupervisionEvent."""

    actor_id: str
    rank: int


@message_type
@dataclass(frozen=True, slots=True)
class Wake:
    """To a reply inbox: a call of its thread was settled elsewhere; look at it again."""


@message_type
@dataclass(frozen=True, slots=True)
class InboxClosed:
    """Caller → the procs it called from a thread that has ended: its reply inbox at
    `address` is closed, so they drop their connection to it (two descriptors each)."""

    address: str


@message_type
@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Proc → its agent, every heartbeat interval, from a thread that needs the GIL."""

    proc_id: str


@message_type
@dataclass(frozen=True, slots=True)
class WatchProcs:
    """To an agent: also tell `watcher` when any of these procs exits (callers that do not own
    them). Procs already gone are reported at once."""

    proc_ids: tuple[str, ...]
    watcher: str


@message_type
@dataclass(frozen=True, slots=True)
class OwnerAlive:
    """Owner → agent, periodically, from clients that attached over the network: the agent
    stops the owner's procs if these stop coming for longer than its orphan timeout."""

    owner: str


@message_type
@dataclass(frozen=True, slots=True)
class AgentAlive:
    """Agent → a network owner, in answer to OwnerAlive: the owner declares the agent's procs
    unreachable when these stop coming (a lost host, a cut link), or when `incarnation`
    changes (the agent was restarted at the same address: its old procs died with it)."""

    agent: str
    incarnation: str


@message_type
@dataclass(frozen=True, slots=True)
class ProcReplaced:
    """Agent → watchers of a proc that was re-spawned: the same rank now lives here."""

    old_proc_id: str
    proc_id: str
    address: str
    pid: int
    host: str
