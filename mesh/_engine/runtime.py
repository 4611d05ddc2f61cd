"""`Runtime`: one per process. Owns the inbox, the outbox, the event loop and pending calls.

In the client the event loop runs on a daemon thread, so user code on the main thread stays
free; in a proc it runs on the main thread. Actors' sync code runs on worker threads (see
`mesh._engine.workers`); a `Future.get()` made on the loop thread itself (blocking code in an async
endpoint) pumps the inbox instead of blocking it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from mesh._engine.calls import PendingCall, ResultSink
from mesh._engine.fault_rules import apply_fault_rules
from mesh._engine.fork import check_not_forked
from mesh._engine.future import Future
from mesh._engine.host import ActorHost
from mesh._engine.messages import (
    ActorFailed,
    AgentAlive,
    CallActor,
    Failure,
    InboxClosed,
    OwnerAlive,
    ProcExited,
    ProcReady,
    ProcReplaced,
    Reply,
    SetFaultRules,
    SpawnActor,
    SpawnFailed,
    StopActor,
    StopProc,
    StopProcs,
)
from mesh._engine.peers import ActorMeshView, ProcPeer
from mesh._engine.replies import ReplyInbox, ReplyRoutes
from mesh._engine.restarts import Restarts
from mesh._engine.supervisor import Supervisor
from mesh._settings import Settings, current_settings
from supervision import ActorError, EventKind, SupervisionError, SupervisionEvent
from transport import (
    Envelope,
    Inbox,
    Outbox,
    Payload,
    TransportError,
    close_context,
    encode,
    get_logger,
    loads,
    new_context,
    transport_settings,
)

_RECEIVE_BATCH = 256


class Runtime:
    """The messaging core of one process (the client or a proc)."""

    def __init__(
        self,
        address: str,
        *,
        proc_id: str,
        agent: str | None = None,
        is_root: bool = False,
        settings: Settings | None = None,
    ) -> None:
        #: Read when used, so that `mesh.configure` reaches a running runtime.
        self.settings = settings if settings is not None else current_settings()
        self.proc_id = proc_id
        self.agent = agent
        self.hostname = socket.gethostname()
        self.pid = os.getpid()
        self.zmq_context = new_context()
        self.inbox = Inbox(self.zmq_context, address)
        self.outbox = Outbox(self.zmq_context)
        self.address = self.inbox.address
        self.inbox_dir = os.path.dirname(address[6:]) if address.startswith("ipc://") else None
        self.tcp_host = _tcp_host(self.address)
        self._attached_agents: set[str] = set()
        self._agent_heard: dict[str, float] = {}
        self._agent_incarnations: dict[str, str] = {}
        self._silent_agents: set[str] = set()  # lost to silence, not heard from since
        self._lost_agents: dict[str, str] = {}  # local agent -> why its process is gone
        self.replies = ReplyRoutes(self)
        self.host = ActorHost(self)
        self.peers: dict[str, ProcPeer] = {}
        self.calls: dict[int, PendingCall] = {}
        self.supervisor = Supervisor(self, is_root=is_root)
        self.restarts = Restarts(self)
        self._stopping_agents: set[str] = set()
        self.closing = False  # set while the session shuts down: exits are expected then
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._loop_thread: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_context = contextvars.Context()  # the event loop's, for call_soon
        self._wakeup: anyio.Event | None = None
        self._task_group: Any = None
        self._started = threading.Event()
        self._stopping = False
        self._finished = threading.Event()
        self.closed = threading.Event()
        self._nested = 0
        self._log = get_logger("mesh.runtime", proc=proc_id)
        self._handlers: dict[type, Callable[[Envelope], None]] = {
            Reply: self.on_reply,
            Failure: self.on_failure,
            ProcReady: self._on_proc_ready,
            ProcExited: self._on_proc_exited,
            SpawnFailed: self._on_spawn_failed,
            ActorFailed: self._on_actor_failed,
            StopProc: self._on_stop_proc,
            AgentAlive: self._on_agent_alive,
            ProcReplaced: self._on_proc_replaced,
            SetFaultRules: apply_fault_rules,
            InboxClosed: self._on_inbox_closed,
        }

    # -- the event loop ------------------------------------------------------------------------

    def run(self) -> None:
        """Run the event loop on this thread until `stop_loop` (or a StopProc message)."""
        try:
            anyio.run(self._main)
        finally:
            self._finished.set()

    def start_in_thread(self) -> None:
        threading.Thread(target=self.run, name="meshvisor-runtime", daemon=True).start()
        self._started.wait()

    async def _main(self) -> None:
        self._loop_thread = threading.get_ident()
        self._loop = asyncio.get_running_loop()
        self._loop_context = contextvars.copy_context()
        self._wakeup = anyio.Event()
        async with anyio.create_task_group() as task_group:
            self._task_group = task_group
            self._loop.add_reader(self.inbox.fileno(), self._on_readable)
            self._started.set()
            self._on_readable()  # anything that arrived before the reader was installed
            await self._wakeup.wait()
            self._loop.remove_reader(self.inbox.fileno())
            task_group.cancel_scope.cancel()

    def _on_readable(self) -> None:
        """Called by the event loop whenever the inbox may have messages: dispatch them."""
        if self._nested:
            return  # a pumping Future.get() further up this thread's stack is receiving
        if not self._drain(_RECEIVE_BATCH) and not self._stopping:
            assert self._loop is not None
            self._loop.call_soon(self._on_readable)  # let other tasks run, then continue

    def _drain(self, limit: int) -> bool:
        """Dispatch up to `limit` waiting messages; True when the inbox is empty."""
        for _ in range(limit):
            envelope = self.inbox.receive_nowait()
            if envelope is None:
                return True
            self._dispatch(envelope)
        return False

    def _dispatch(self, envelope: Envelope) -> None:
        kind = type(envelope.header)
        try:
            if kind is CallActor or kind is SpawnActor or kind is StopActor:
                self.host.deliver(envelope)
                return
            handler = self._handlers.get(kind)
            if handler is None:
                self._log.warning(
                    "message_ignored", kind=kind.__name__, reason="this process does not handle it"
                )
                return
            handler(envelope)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception:
            self._log.exception("message_handling_failed", kind=kind.__name__)

    def dispatch_elsewhere(self, envelope: Envelope) -> None:
        """Hand a message received off the loop thread to the loop thread."""
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._dispatch, envelope)

    def call_soon(self, function: Callable[..., Any], *args: Any) -> None:
        """Run `function(*args)` on the loop thread soon, from any thread, in the loop's own
        context (where anyio finds its backend); a no-op once the loop has closed."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(function, *args, context=self._loop_context)

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_thread

    def call_later(self, delay_s: float, function: Callable[..., Any], *args: Any) -> None:
        """Run `function(*args)` on the loop thread after `delay_s` (loop thread only)."""
        assert self._loop is not None
        self._loop.call_later(delay_s, function, *args)

    def call_soon_threadsafe(self, function: Callable[..., Any], *args: Any) -> None:
        """Run `function(*args)` soon on the loop thread, from any thread (a no-op once the
        loop has finished: close() cleans up then)."""
        loop = self._loop
        if loop is None or self._finished.is_set():
            return
        try:
            loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the loop has just closed
            pass

    def start_task(self, function: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start a task on the event loop (loop thread only)."""
        self._task_group.start_soon(function, *args)

    def pump_until(self, future: Future[Any], timeout: float | None) -> None:
        """Receive and dispatch on this (loop) thread until `future` is done or time is up."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._nested += 1
        try:
            while not future.finished():
                envelope = self.inbox.receive_nowait()
                if envelope is not None:
                    self._dispatch(envelope)
                    continue
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self.inbox.poll(None if remaining is None else max(1, int(remaining * 1000)))
            self._drain(1 << 30)  # leave nothing behind the edge-triggered descriptor
        finally:
            self._nested -= 1

    def stop_loop(self) -> None:
        """Ask the event loop to finish (from any thread) and wait for it."""
        if self._loop_thread is None or self._finished.is_set():
            return
        if self.on_loop_thread():
            self._request_stop()
            return
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._request_stop)
        except RuntimeError:  # the loop has already closed
            return
        self._finished.wait(5)

    def _request_stop(self) -> None:
        self._stopping = True
        assert self._wakeup is not None
        self._wakeup.set()

    def close(self) -> None:
        self.closed.set()
        self.replies.close()
        self.outbox.close(linger_ms=500)
        self.inbox.close()
        close_context(self.zmq_context)

    # -- sending -------------------------------------------------------------------------------

    def send_message(self, address: str, header: Any, payload: Payload | None = None) -> None:
        """Send one message; an unreachable address is logged, never raised to a handler."""
        try:
            frames = encode(header, payload)
        except TransportError as exc:
            self._log.warning(
                "send_failed", to=address, kind=type(header).__name__, reason=str(exc)
            )
            return
        self.send_frames(address, header, frames)

    def send_frames(self, address: str, header: Any, frames: list[Any]) -> None:
        """Send the frames `encode` made for `header`; an unreachable address is logged."""
        try:
            self.outbox.send(address, frames)
        except TransportError as exc:
            self._log.warning(
                "send_failed", to=address, kind=type(header).__name__, reason=str(exc)
            )

    def new_call_id(self) -> int:
        return next(self._ids)

    def send_to_procs(
        self,
        messages: list[tuple[ProcPeer, Any]],
        payload: Payload | None,
        sink: ResultSink | None,
        call_id: int = 0,
        home: ReplyInbox | None = None,
        mesh: ActorMeshView | None = None,
    ) -> None:
        """Send one header per peer (same payload). With a `sink`, each header's `rank` keys
        its reply. `mesh`: the actor mesh addressed, named in the errors of gone procs."""
        check_not_forked(self.pid)
        failed: list[tuple[int, BaseException]] = []
        with self._lock:
            if sink is not None:
                peers = {header.rank: peer for peer, header in messages}
                self.calls[call_id] = PendingCall(call_id, sink, peers, home, mesh)
                if home is not None:  # they will connect to it, and drop that when it closes
                    home.called.update(peers.values())
            for peer, header in messages:
                frames = encode(header, payload)
                if not peer.alive:
                    assert peer.event is not None
                    failed.append((header.rank, _gone_error(peer, peer.event, mesh)))
                    continue
                if sink is not None:
                    peer.calls.add(call_id)
                if peer.address is None:  # copy now: the caller may change its buffers
                    peer.queued.append([frames[0], *(bytes(memoryview(b)) for b in frames[1:])])
                else:
                    self.outbox.send(peer.address, frames)
        for index, error in failed:
            self._settle(call_id, index, error=error)

    # -- replies ---------------------------------------------------------------------------------

    def on_reply(self, envelope: Envelope) -> None:
        header: Reply = envelope.header
        try:
            value = envelope.payload.load()  # type: ignore[union-attr]
        except Exception as exc:
            self._settle(
                header.call_id,
                header.rank,
                error=ActorError(
                    f"the result of call {header.call_id} could not be unpickled here: {exc!r}"
                ),
            )
            return
        self._settle(header.call_id, header.rank, value=value)

    def on_failure(self, envelope: Envelope) -> None:
        header: Failure = envelope.header
        try:
            detail = envelope.payload.load()  # type: ignore[union-attr]
            if header.kind == "exception":
                error: BaseException = _actor_error(*detail)
            else:
                error = SupervisionError(detail)
        except Exception as exc:  # the call must end even when its error cannot be rebuilt
            error = ActorError(
                f"call {header.call_id} failed ({header.kind}), but the error could not be "
                f"unpickled here: {exc!r}"
            )
        self._settle(header.call_id, header.rank, error=error)

    def inboxes_awaiting_replies(self) -> set[int]:
        """The ids of the reply inboxes that pending calls will be answered at."""
        with self._lock:
            return {id(call.home) for call in self.calls.values() if call.home is not None}

    def _on_inbox_closed(self, envelope: Envelope) -> None:
        """A caller's reply inbox is gone: drop the connection made to answer it."""
        self.outbox.forget(envelope.header.address)

    def _settle(
        self, call_id: int, rank: int, *, value: Any = None, error: BaseException | None = None
    ) -> None:
        with self._lock:
            pending = self.calls.get(call_id)
            if pending is None:
                return
            peer = pending.peers.pop(rank, None)
            if peer is None:
                return
            if not any(other is peer for other in pending.peers.values()):
                peer.calls.discard(call_id)
            if not pending.peers:
                del self.calls[call_id]
        if error is None:
            pending.sink.deliver(rank, value)
        else:
            pending.sink.fail(rank, error)

    # -- procs -----------------------------------------------------------------------------------

    def add_peer(self, peer: ProcPeer) -> ProcPeer:
        with self._lock:
            self.peers[peer.proc_id] = peer
        return peer

    def _on_proc_replaced(self, envelope: Envelope) -> None:
        """A proc this process calls (but does not own) was re-spawned: follow it."""
        header: ProcReplaced = envelope.header
        peer = self.peers.get(header.old_proc_id)
        if peer is None or peer.owned:
            return
        self.rekey_peer(peer, header.proc_id)
        with self._lock:
            if peer.state != "starting":  # its old proc's exit never reached us
                peer.hold()
        self._peer_ready(ProcReady(header.proc_id, header.address, header.pid, header.host))

    def _on_proc_ready(self, envelope: Envelope) -> None:
        self._peer_ready(envelope.header)

    def _peer_ready(self, header: ProcReady) -> None:
        with self._lock:
            peer = self.peers.get(header.proc_id)
            if peer is None or peer.state != "starting":
                return
            peer.address, peer.pid, peer.host, peer.state = (
                header.address,
                header.pid,
                header.host,
                "ready",
            )
            queued, peer.queued = peer.queued, []
            for frames in queued:
                self.outbox.send(header.address, frames)
        peer.ready.set_result(None)
        self._log.info("proc_ready", proc=header.proc_id, pid=header.pid, address=header.address)

    def _on_proc_exited(self, envelope: Envelope) -> None:
        header: ProcExited = envelope.header
        peer = self.peers.get(header.proc_id)
        if peer is None:
            return
        kind: EventKind
        if header.requested or peer.state == "stopping":
            kind, message = "stopped", "by its owner"
        elif header.hung:
            kind, message = "hung", f"it was killed by the host agent ({header.signal})"
            if header.why_hung:
                message = f"{header.why_hung}; {message}"
        elif header.signal is not None:
            kind, message = "signal", ""
        else:
            kind, message = "exit", ""
        event = peer.make_event(
            kind,
            message,
            host=header.host,
            pid=header.pid,
            exit_code=header.exit_code,
            signal=None if header.hung else header.signal,
        )
        self.mark_peer_gone(peer, event, "stopped" if kind == "stopped" else "failed")

    def _on_spawn_failed(self, envelope: Envelope) -> None:
        header: SpawnFailed = envelope.header
        peer = self.peers.get(header.proc_id)
        if peer is not None:
            event = peer.make_event("spawn_failed", header.reason, host=header.host)
            self.mark_peer_gone(peer, event, "failed")

    def mark_peer_gone(self, peer: ProcPeer, event: SupervisionEvent, state: str) -> None:
        """Record that `peer` is gone and fail every call still waiting on it."""
        with self._lock:
            if peer.finished:
                return
            peer.state, peer.event, peer.queued = state, event, []
            waiting = [
                (call_id, self.calls[call_id]) for call_id in peer.calls if call_id in self.calls
            ]
            peer.calls = set()
        if peer.address:
            self.outbox.forget(peer.address)
        error = SupervisionError(event)
        ready, gone = peer.ready, peer.gone
        escalate: SupervisionEvent | None = None
        if state == "failed" and peer.owned and not self.closing:
            self.supervisor.observe(self._told_to_owner(peer, event)[0])
            # decide (and hold the peer for a restart) before anyone hears of the failure
            escalate = self.restarts.on_proc_failure(peer, event)
        ready.set_exception(error)
        gone.set_result(None)
        for call_id, pending in waiting:
            for rank, target in list(pending.peers.items()):
                if target is peer:
                    self._settle(call_id, rank, error=_gone_error(peer, event, pending.mesh))
            if pending.home is not None:
                pending.home.wake()
        if escalate is not None:
            subject, told = self._told_to_owner(peer, escalate)
            keys = self.supervisor.handlers_for_proc(peer.proc_id, peer.mesh_key)
            self.supervisor.handle(subject, peer.owner_actor, keys, told)
        elif state == "stopped":
            self._log.info("proc_stopped", proc=peer.proc_id, pid=event.pid)
            self._forget_if_stopped(peer)

    def _forget_if_stopped(self, peer: ProcPeer) -> None:
        """Drop the bookkeeping of a stopped proc (of its whole mesh, for one spawned here):
        handles the user still holds keep working, and say it was stopped."""
        record = self.restarts.forget_stopped(peer) if peer.owned else None
        if peer.owned and record is None:
            return
        gone = record.peers if record is not None else (peer,)
        with self._lock:
            for each in gone:
                if self.peers.get(each.proc_id) is each:
                    del self.peers[each.proc_id]
        if record is not None:
            actor_ids = [actors.actor_id for actors in record.actor_meshes]
            self.supervisor.forget_mesh(record.key, actor_ids, [p.proc_id for p in gone])

    def _told_to_owner(
        self, peer: ProcPeer, event: SupervisionEvent
    ) -> tuple[SupervisionEvent, dict[str, SupervisionEvent]]:
        """What the owner hears of `peer`'s proc failing: the event of the first actor mesh
        on it (the proc's own if none), and the event each handler key hears (an actor mesh's
        handler: its actor's; the proc mesh's handler: the proc's)."""
        told: dict[str, SupervisionEvent] = {}
        for mesh_id in self.supervisor.actor_meshes_on.get(peer.proc_id, ()):
            record = self.restarts.actor_meshes.get(mesh_id)
            if record is not None:
                told[mesh_id] = record.view().proc_failed(peer, event)
        subject = next(iter(told.values()), event)
        told[peer.mesh_key] = event
        return subject, told

    def _on_actor_failed(self, envelope: Envelope) -> None:
        header: ActorFailed = envelope.header
        event: SupervisionEvent = envelope.payload.load()  # type: ignore[union-attr]
        self.supervisor.observe(event)
        escalate = self.restarts.on_actor_failure(header.actor_id, header.rank, event)
        if escalate is None:
            return  # a restart policy takes care of it
        peer = self.peers.get(event.proc_id or "")
        keys = (header.actor_id,) + ((peer.mesh_key,) if peer is not None else ())
        owner = self.supervisor.actor_mesh_owners.get(header.actor_id)
        self.supervisor.handle(escalate, owner, keys)

    def watch_agent_process(self, address: str, pid: int) -> None:
        """Report every proc of a local agent as unreachable if that agent process dies."""
        fd = os.pidfd_open(pid)

        def on_exit() -> None:
            assert self._loop is not None
            self._loop.remove_reader(fd)
            os.close(fd)
            stopping = address in self._stopping_agents
            self._lost_agents[address] = f"(pid {pid}) {'was shut down' if stopping else 'died'}"
            if not stopping:
                self._agent_lost(address, self._lost_agents[address])

        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.add_reader, fd, on_exit)

    def agent_stopping(self, address: str) -> None:
        """The agent at `address` is being shut down on purpose: its exit is no failure."""
        self._stopping_agents.add(address)

    def check_agent(self, agent: str) -> None:
        """Procs were just requested from `agent`: if its process is known to be gone, fail
        them now; if it is silent or being shut down, fail them unless it answers within
        settings.agent_timeout_s (a partition may heal). Either way the request ends."""
        doubtful = agent in self._silent_agents or agent in self._stopping_agents
        if doubtful or agent in self._lost_agents:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._check_gone_agent, agent, time.monotonic())

    def _check_gone_agent(self, agent: str, requested_at: float) -> None:
        why = self._lost_agents.get(agent)
        if why is not None:
            self._fail_procs_of(agent, why)
        else:
            self.call_later(
                self.settings.agent_timeout_s, self._fail_if_still_silent, agent, requested_at
            )

    def _fail_if_still_silent(self, agent: str, requested_at: float) -> None:
        heard = self._agent_heard.get(agent, requested_at)
        if heard > requested_at:
            return  # it answered since: the request reached it
        if agent in self._stopping_agents:
            self._fail_procs_of(agent, f"at {agent} was shut down by this process")
        elif agent in self._silent_agents:
            self._fail_procs_of(
                agent, f"at {agent} gave no answer for {time.monotonic() - heard:.1f} s"
            )

    def listen_on_tcp(self, host: str) -> None:
        """Also listen on tcp (for procs on other hosts); replies and ownership use it."""
        if self.tcp_host is None:
            self.address = self.inbox.listen_also(f"tcp://{host}:*")
            self.tcp_host = host

    def keep_alive(self, agents: list[str]) -> None:
        """Tell these agents, periodically, that this owner lives (they reap our procs if
        it stops: a network owner has no pid they could watch)."""
        new = set(agents) - self._attached_agents
        self._attached_agents |= new
        assert self._loop is not None
        if new and len(self._attached_agents) == len(new):
            self._loop.call_soon_threadsafe(self._send_owner_alive)
        else:  # the loop runs already: greet the new ones now, so that their incarnation is
            for agent in sorted(new):  # known before a restart could hide it
                self._loop.call_soon_threadsafe(self.send_message, agent, OwnerAlive(self.address))

    def attached_agents(self) -> list[str]:
        """The network agents this process attached to (and keeps alive)."""
        return sorted(self._attached_agents)

    def _send_owner_alive(self) -> None:
        if self.closed.is_set():
            return
        now = time.monotonic()
        for agent in list(self._attached_agents):
            self.send_message(agent, OwnerAlive(self.address))
            heard = self._agent_heard.setdefault(agent, now)
            silent = (
                now - heard > self.settings.agent_timeout_s and agent not in self._stopping_agents
            )
            if silent and agent not in self._silent_agents:  # each silence once
                self._silent_agents.add(agent)
                why = self._refused_by(agent) or f"gave no answer for {now - heard:.1f} s"
                self._agent_lost(agent, f"at {agent} {why}")
        self.call_later(self.settings.owner_alive_interval_s, self._send_owner_alive)

    def _refused_by(self, agent: str) -> str | None:
        """Why `agent` refuses this process (its CURVE keys), in words, or None."""
        reason = self.outbox.refusal(agent)
        if reason is None:
            return None
        return (
            f"refused this process: {reason} (wrong or missing CURVE keys: this process uses "
            f"those in {transport_settings().curve_keys}; use the keys of the agent's "
            "allocation, the directory of its --keys, or attach by allocation name)"
        )

    def _on_agent_alive(self, envelope: Envelope) -> None:
        header: AgentAlive = envelope.header
        if header.agent not in self._attached_agents:
            return  # not an agent this process keeps alive: nothing to learn
        self._agent_heard[header.agent] = time.monotonic()
        self._silent_agents.discard(header.agent)
        known = self._agent_incarnations.setdefault(header.agent, header.incarnation)
        if known != header.incarnation:
            self._agent_incarnations[header.agent] = header.incarnation
            self._agent_lost(header.agent, "was restarted, and its procs died with the old one")

    def _agent_lost(self, agent: str, why: str) -> None:
        """Every live proc of `agent` failed with kind "unreachable"."""
        self._log.error("agent_lost", agent=agent, reason=why)
        self._fail_procs_of(agent, why)

    def _fail_procs_of(self, agent: str, why: str) -> None:
        with self._lock:
            lost = [p for p in self.peers.values() if p.agent == agent and p.alive]
        for peer in lost:
            self.mark_peer_gone(
                peer, peer.make_event("unreachable", f"its host agent {why}"), "failed"
            )
        # If the agent is only cut off, it gets this once the link is back: procs given up
        # for lost must not live on beside their replacements.
        owned = tuple(p.proc_id for p in lost if p.owned)
        if owned:
            self.send_message(agent, StopProcs(owned, 0.0))

    def stop_all_owned(self, grace_s: float) -> None:
        """Ask the agents to stop every proc this process spawned (at shutdown)."""
        with self._lock:
            owned = [p for p in self.peers.values() if p.owned and p.alive]
        self.stop_peers(owned, grace_s)

    def hold_calls(self, peer: ProcPeer) -> None:
        """A failed peer will be re-spawned: from now on calls to it wait for the new proc,
        for at most settings.restart_wait_s."""
        with self._lock:
            peer.hold()
            ready = peer.ready
        self.call_later(self.settings.restart_wait_s, self._restart_overdue, peer, ready)

    def _restart_overdue(self, peer: ProcPeer, ready: Future[None]) -> None:
        if peer.ready is not ready or ready.finished() or peer.state != "starting":
            return  # it came back (or failed, or was stopped) in time
        self.restarts.cancel(peer)
        message = f"its restart did not complete within {self.settings.restart_wait_s} s"
        self.mark_peer_gone(peer, peer.make_event("spawn_failed", message), "failed")

    def rekey_peer(self, peer: ProcPeer, proc_id: str) -> None:
        """Give `peer` the id of the proc that replaces it (keeping the calls that wait)."""
        with self._lock:
            self.peers.pop(peer.proc_id, None)
            if peer.finished:
                peer.hold()
            old_id, peer.proc_id = peer.proc_id, proc_id
            self.peers[proc_id] = peer
            meshes_on = self.supervisor.actor_meshes_on.pop(old_id, None)
            if meshes_on is not None:
                self.supervisor.actor_meshes_on[proc_id] = meshes_on

    def stop_peers(self, peers: list[ProcPeer], grace_s: float, why: str = "by its owner") -> None:
        """Stop these procs on purpose: gracefully, SIGKILL after `grace_s`; their exit is
        reported as "stopped", never as a failure."""
        check_not_forked(self.pid)
        by_agent: dict[str, list[str]] = {}
        with self._lock:
            for peer in peers:
                if peer.alive and peer.agent is not None:
                    peer.state, peer.event = "stopping", peer.stopped_event(why)
                    by_agent.setdefault(peer.agent, []).append(peer.proc_id)
        for agent, proc_ids in by_agent.items():
            self.send_message(agent, StopProcs(tuple(proc_ids), grace_s, self.address))

    def stop_owned_by(self, actor_id: str, grace_s: float = 5.0) -> None:
        """Stop every proc that actor `actor_id` spawned (a mesh never outlives its owner)."""
        with self._lock:
            owned = [peer for peer in self.peers.values() if peer.owner_actor == actor_id]
        self.stop_peers(owned, grace_s, "because its owner stopped or failed")

    def _on_stop_proc(self, envelope: Envelope) -> None:
        if self.supervisor.is_root:  # only procs are stopped by their agent; a client ends itself
            self._log.warning("message_ignored", kind="StopProc", reason="the client has no agent")
            return
        self.host.stop_all()
        self._request_stop()


def _gone_error(
    peer: ProcPeer, event: SupervisionEvent, mesh: ActorMeshView | None
) -> SupervisionError:
    """The error for a call to an actor on `peer`, whose proc failed or was stopped (`event`):
    about the actor when the actor mesh called is known, else about the proc."""
    return SupervisionError(event if mesh is None else mesh.proc_failed(peer, event))


def _actor_error(
    fields: dict[str, Any], original: bytes | None, original_class: bytes | None
) -> ActorError:
    """Rebuild the caller's ActorError. It keeps the original type even when the exception
    instance cannot be unpickled here (a constructor with extra arguments, say)."""
    exception = _unpickled_or_none(original)
    exception_class = _unpickled_or_none(original_class) if exception is None else None
    message = (
        f"endpoint {fields['endpoint']!r} of mesh {fields['mesh_name']!r} at rank "
        f"{fields['rank']} (pid {fields['pid']} on {fields['host']}) raised "
        f"{fields['exception_type']}: {fields['message']}"
    )
    fields = {k: v for k, v in fields.items() if k not in ("message", "call_rank")}
    return ActorError.wrap(message, exception=exception, exception_class=exception_class, **fields)


def _unpickled_or_none(data: bytes | None) -> Any:
    if data is None:
        return None
    try:
        return loads(data)
    except Exception:
        return None


def _tcp_host(address: str) -> str | None:
    """The host part of a tcp address, None for other transports."""
    if not address.startswith("tcp://"):
        return None
    return address[len("tcp://") :].rsplit(":", 1)[0]
