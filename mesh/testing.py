"""Fault hooks and helpers for testing meshvisor jobs (as ``trio.testing`` is for trio).

The fault hooks (`probe`, `fail_next_call`, `exit_process`, `break_links`, `heal_links`) are
what the `chaos` package injects faults with; nothing here changes a job that does not call it.

`settings(**overrides)` is `mesh.configured` (settings for one block). The other helpers let tests
look at this process's session (`run_dir`, `inbox_address`, `local_agent`, `known_agents`,
`bookkeeping`), make it hand out its tcp address to all (`hand_out_widest_address`), stop or kill
itself at a precise line (`signal_this_process`), check which malloc tunables a forked proc can
apply (`apply_malloc_tunables`), end it or parts of it (`shutdown`, `stop_local_agent`,
`stop_controllers`), hold a call without the call watchdog judging it (`call_watchdog_suspended`, as
a debugger does), check the slicing algebra without processes (`Region`), write, rotate and
aggregate proc lines without procs (`RankLog`, `LogFileConfig`, `line_level`, `Aggregator`,
`RankedLine`), and play a raw peer of an agent or a proc with the typed wire messages of `wire` (and
`detached_wire`, those of detached meshes; `debug_wire`, those of the distributed debugger;
`workspace_wire`, those of workspace sync, whose paths an agent checks with
`workspace_path_problem`; `fanout_wire`, those of fanned-out calls; `shared_payload_wire`, the
memory files of shared payloads; `arena_wire`, the payload arena procs read them from, and
`PayloadArena`, an agent's half of it; `FanOutRelay`, an agent's half of fanned-out calls, over a
`ProcTable` of `ProcRecord`s; `Watchdog`, an agent's heartbeat deadlines over such a table, and
`OwnWaits`, the agent's own waiting for a core that gives its silent procs more time;
`HandshakeWaits`, a proc's watch over answers sent to callers whose handshake had not passed,
and `RelayHandshakes`, an agent's over the answers of fanned-out calls it sends on;
`DeathWatch`, the fork server's robust mutexes that tell a proc killed before it is reaped, from
a child of the fork server that is no proc, named `DEATH_WAITER_NAME`, where the kernel has
futex_waitv: `SEES_DEATHS_EARLY`).
`listen_on_tcp` makes this process listen on tcp as adopting a handle from another host does,
and tells which thread bound its inbox; `ReaderCalls` runs such binds on an `EventLoop`'s thread.
`fan_out_from` sets when calls go through host agents, and `fanned_out` tells which path an actor
mesh's last messages took. Each reads the engine in one place, here.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mesh._agent.death_waiter import WAITER_NAME as DEATH_WAITER_NAME
from mesh._agent.death_watch import SEES_DEATHS_EARLY as SEES_DEATHS_EARLY
from mesh._agent.death_watch import DeathWatch as DeathWatch
from mesh._agent.liveness import OwnWaits as OwnWaits
from mesh._agent.log_files import LogFileConfig as LogFileConfig
from mesh._agent.log_files import RankLog as RankLog
from mesh._agent.log_records import line_level as line_level
from mesh._agent.malloc_tunables import apply_malloc_tunables as apply_malloc_tunables
from mesh._agent.payload_arena import PayloadArena as PayloadArena
from mesh._agent.procs import ProcRecord as ProcRecord
from mesh._agent.procs import ProcTable as ProcTable
from mesh._agent.relay import FanOutRelay as FanOutRelay
from mesh._agent.relay_handshakes import RelayHandshakes as RelayHandshakes
from mesh._agent.watchdog import Watchdog as Watchdog
from mesh._api.actor_mesh import ActorMesh as _ActorMesh
from mesh._api.configure import configured as settings
from mesh._api.controllers import stop_controllers as stop_controllers
from mesh._api.faults import Party as Party
from mesh._api.faults import break_links as break_links
from mesh._api.faults import exit_process as exit_process
from mesh._api.faults import fail_next_call as fail_next_call
from mesh._api.faults import heal_links as heal_links
from mesh._api.faults import probe as probe
from mesh._engine import debug_messages as debug_wire
from mesh._engine import detached_messages as detached_wire
from mesh._engine import fanout_messages as fanout_wire
from mesh._engine import messages as wire
from mesh._engine import payload_arena as arena_wire
from mesh._engine import session as _session
from mesh._engine import shared_payload as shared_payload_wire
from mesh._engine import workspace_messages as workspace_wire
from mesh._engine.callwatch import call_watchdog_suspended as call_watchdog_suspended
from mesh._engine.handshake_waits import HandshakeWaits as HandshakeWaits
from mesh._engine.loop import EventLoop as EventLoop
from mesh._engine.proc_faults import signal_this_process as signal_this_process
from mesh._engine.proc_lines import Aggregator as Aggregator
from mesh._engine.proc_lines import RankedLine as RankedLine
from mesh._engine.reader_calls import ReaderCalls as ReaderCalls
from mesh._engine.workspace_files import path_problem as workspace_path_problem
from mesh._shape import Region as Region

__all__ = (
    "DEATH_WAITER_NAME",
    "SEES_DEATHS_EARLY",
    "Aggregator",
    "Bookkeeping",
    "DeathWatch",
    "EventLoop",
    "FanOutRelay",
    "HandshakeWaits",
    "LocalAgent",
    "LogFileConfig",
    "OwnWaits",
    "Party",
    "PayloadArena",
    "ProcRecord",
    "ProcTable",
    "RankLog",
    "RankedLine",
    "ReaderCalls",
    "Region",
    "RelayHandshakes",
    "Watchdog",
    "apply_malloc_tunables",
    "arena_wire",
    "bookkeeping",
    "break_links",
    "call_watchdog_suspended",
    "debug_wire",
    "detached_wire",
    "exit_process",
    "fail_next_call",
    "fan_out_from",
    "fanned_out",
    "fanout_wire",
    "greetings_sent",
    "hand_out_widest_address",
    "heal_links",
    "inbox_address",
    "known_agents",
    "line_level",
    "listen_on_tcp",
    "local_agent",
    "probe",
    "receiver_hand_overs",
    "receiver_idle_alarms",
    "receiver_lone_calls",
    "run_dir",
    "settings",
    "shared_payload_wire",
    "shutdown",
    "signal_this_process",
    "stop_controllers",
    "stop_local_agent",
    "wire",
    "workspace_path_problem",
    "workspace_wire",
)


@contextmanager
def hand_out_widest_address() -> Iterator[None]:
    """Inside the block, this process hands every peer its widest address (tcp, once it
    attached to tcp agents) instead of the one nearest to that peer: plays a sender whose
    replies a keyless proc on this host cannot deliver (`Runtime.address_for`)."""
    runtime = _session.current_session().runtime
    runtime.nearest_addresses = False
    try:
        yield
    finally:
        runtime.nearest_addresses = True


@contextmanager
def fan_out_from(recipients: int) -> Iterator[None]:
    """Inside the block, this process sends a call through a host agent from `recipients`
    recipients on that host (`sys.maxsize`: never): both paths, in tests and benchmarks. The
    settings `fanout_min_recipients` and `fanout_min_shared_recipients` for the block
    (`mesh.configured`)."""
    with settings(fanout_min_recipients=recipients, fanout_min_shared_recipients=recipients):
        yield


def fanned_out(actors: _ActorMesh[Any]) -> list[bool]:
    """For each actor of `actors` (all ranks, unsliced): whether this process's last message
    to it went through its host agent (docs/fan-out.md)."""
    state = actors._state
    routes = [peer.routes.get(state.actor_id) for peer in state.peers]
    return [route is not None and route.via_agent for route in routes]


def shutdown() -> None:
    """End this client's session now, as its exit would: stop every mesh it owns, its local
    agent and its event loop, and remove its run directory. The next use starts a new one."""
    _session.shutdown_session()


def stop_local_agent() -> None:
    """Stop the host agent this client started (and every proc it runs), if there is one; the
    next `this_host()` starts a new one, which inherits the file descriptors of that moment."""
    session = _session.session_if_started()
    if session is not None:
        session.shutdown_local_agent()


@dataclass(frozen=True)
class LocalAgent:
    """The host agent process that this client started: its address and its OS process."""

    address: str
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        """The agent's process id."""
        return self.process.pid


def local_agent() -> LocalAgent:
    """The host agent this client started for `this_host()`, started first if need be."""
    session = _session.current_session()
    address = session.agent_address()
    process = session._agent_process
    if process is None:
        raise RuntimeError(
            f"the local agent at {address} was not started by this process (it is a proc, or "
            "its agent was given to it); call local_agent() in the client"
        )
    return LocalAgent(address, process)


def run_dir() -> str:
    """This process's private run directory (its sockets and those of the procs it runs)."""
    return _session.current_session().rundir


def inbox_address(*, local: bool = False) -> str:
    """The address this process receives messages on (the client's, or a proc's inside an
    actor): where a raw peer sends wire messages to reach it. Once the process also listens on
    tcp (it attached to network agents) that is its tcp address, which needs CURVE keys;
    ``local=True`` gives its ipc address on this host, which does not."""
    runtime = _session.current_session().runtime
    return runtime.inbox.address if local else runtime.address


def greetings_sent(address: str) -> int:
    """How many `OwnerAlive` greetings this client has sent the host agent at `address`."""
    return _session.current_session().runtime.agents.greetings[address]


def known_agents() -> frozenset[str]:
    """The addresses of the host agents this client has heard from (an `AgentAlive` that
    told it which incarnation of the agent answers there)."""
    return frozenset(_session.current_session().runtime.agents.incarnations.copy())


@dataclass(frozen=True)
class Bookkeeping:
    """How much this process's runtime keeps about procs: what a leak test counts."""

    procs: int  # procs it knows how to reach
    proc_meshes: int  # proc meshes whose ranks it may re-spawn


def bookkeeping() -> Bookkeeping:
    """Counts of this process's records of procs and proc meshes (stopped ones must go)."""
    runtime = _session.current_session().runtime
    ownership = runtime.ownership
    return Bookkeeping(procs=len(ownership.peers), proc_meshes=len(ownership.proc_meshes))


def receiver_hand_overs() -> int:
    """In a proc (inside an actor): how many times its receiver's watch gave the inbox to
    another worker thread because the task on the receiving thread was stuck (blocked, or busy
    with no call ending). A drain of many short calls, however long, hands nothing over."""
    receiver = _session.current_session().runtime.receiver
    if receiver is None:
        raise RuntimeError("receiver_hand_overs() counts a proc's hand-overs: call it in an actor")
    return receiver.hand_overs


def receiver_idle_alarms() -> int:
    """In a proc (inside an actor): how many times its receiver's watch woke with no task to
    look at (the receiving thread was idle or reading): wake-ups that cost CPU for nothing."""
    receiver = _session.current_session().runtime.receiver
    if receiver is None:
        raise RuntimeError("receiver_idle_alarms() counts a proc's wake-ups: call it in an actor")
    return receiver.idle_alarms


def receiver_lone_calls() -> int:
    """In a proc (inside an actor): how many calls its receiver ran as lone calls (a call
    alone in its frame, of a header seen before, to an idle actor: `mesh/_engine/lone_calls.py`)."""
    runtime = _session.current_session().runtime
    if runtime.receiver is None:
        raise RuntimeError("receiver_lone_calls() counts a proc's calls: call it in an actor")
    return runtime.host.lone_calls.taken


def listen_on_tcp(host: str = "127.0.0.1") -> tuple[str, int | None, bool]:
    """This process listens on tcp too, as when it adopts a handle with a peer on another
    host: its tcp address, the thread that bound its inbox there (None: bound before), and
    whether no other thread was reading the inbox then (a proc's receiver; zmq's rule)."""
    runtime = _session.current_session().runtime
    inbox, bound_on, alone = runtime.inbox, [], []
    plain = inbox.listen_also

    def noted(address: str) -> str:
        bound_on.append(threading.get_ident())
        alone.append(runtime.receiver is None or not runtime.receiver.read_elsewhere())
        return plain(address)

    setattr(inbox, "listen_also", noted)  # noqa: B010 (an instance's method, for this call)
    try:
        runtime.listen_on_tcp(host)
    finally:
        delattr(inbox, "listen_also")
    assert runtime.addresses.tcp is not None
    return runtime.addresses.tcp, bound_on[0] if bound_on else None, all(alone)
