"""`Runtime`: one per process. Owns the inbox, the outbox, the event loop and pending calls.

In the client the event loop runs on a daemon thread, so user code on the main thread stays
free; in a proc it runs on the main thread. A `Future.get()` made on the loop thread itself (a
sync endpoint calling another actor) pumps the inbox instead of blocking it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from supervision import ActorError, EventKind, SupervisionError, SupervisionEvent
from transport import (
    KEYS_ENV,
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
)

from ._calls import PendingCall, ResultSink
from ._fault_rules import apply_fault_rules
from ._future import Future
from ._host import ActorHost
from ._messages import (
    ActorFailed,
    AgentAlive,
    CallActor,
    Failure,
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
from ._peers import ProcPeer
from ._replies import ReplyInbox, ReplyRoutes
from ._restarts import Restarts
from ._supervisor import Supervisor

_RECEIVE_BATCH = 256
#: How often an owner that attached to agents over the network tells them it is alive.
OWNER_ALIVE_INTERVAL_S = 0.5
#: How long calls to a restarting rank wait for it before failing.
RESTART_WAIT_S = float(os.environ.get("MESHVISOR_RESTART_WAIT_S", 30.0))
#: A network agent silent this long is lost: its procs become "unreachable".
AGENT_TIMEOUT_S = float(os.environ.get("MESHVISOR_AGENT_TIMEOUT_S", 2.0))


class Runtime:
    """The messaging core of one process (the client or a proc)."""

    def __init__(
        self, address: str, *, proc_id: str, agent: str | None = None, is_root: bool = False
    ) -> None:
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
                self.host.deliver(envelope, nested=self._nested > 0)
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

    @property
    def nested(self) -> bool:
        """True while a Future.get() on the loop thread is pumping the inbox."""
        return self._nested > 0

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_thread

    def call_later(self, delay_s: float, function: Callable[..., Any], *args: Any) -> None:
        """Run `function(*args)` on the loop thread after `delay_s` (loop thread only)."""
        assert self._loop is not None
        self._loop.call_later(delay_s, function, *args)

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
            self.outbox.send(address, encode(header, payload))
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
    ) -> None:
        """Send one header per peer (same payload). With a `sink`, each header's `rank` keys
        its reply."""
        failed: list[tuple[int, BaseException]] = []
        with self._lock:
            if sink is not None:
                peers = {header.rank: peer for peer, header in messages}
                self.calls[call_id] = PendingCall(call_id, sink, peers, home)
            for peer, header in messages:
                frames = encode(header, payload)
                if not peer.alive:
                    failed.append((header.rank, peer.error()))
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
        detail = envelope.payload.load()  # type: ignore[union-attr]
        if header.kind == "exception":
            error: BaseException = _actor_error(*detail)
        else:
            error = SupervisionError(detail)
        self._settle(header.call_id, header.rank, error=error)

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
            self.supervisor.observe(event)
            # decide (and hold the peer for a restart) before anyone hears of the failure
            escalate = self.restarts.on_proc_failure(peer, event)
        ready.set_exception(error)
        gone.set_result(None)
        for call_id, pending in waiting:
            for rank, target in list(pending.peers.items()):
                if target is peer:
                    self._settle(call_id, rank, error=error)
            if pending.home is not None:
                pending.home.wake()
        if escalate is not None:
            keys = self.supervisor.handlers_for_proc(peer.proc_id, peer.mesh_key)
            self.supervisor.handle(escalate, peer.owner_actor, keys)
        elif state == "stopped":
            self._log.info("proc_stopped", proc=peer.proc_id, pid=event.pid)

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
            if address not in self._stopping_agents:
                self._agent_lost(address, f"(pid {pid}) died")

        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.add_reader, fd, on_exit)

    def agent_stopping(self, address: str) -> None:
        """The agent at `address` is being shut down on purpose: its exit is no failure."""
        self._stopping_agents.add(address)

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
            silent = now - heard > AGENT_TIMEOUT_S and agent not in self._stopping_agents
            if silent and agent not in self._silent_agents:  # each silence once
                self._silent_agents.add(agent)
                why = self._refused_by(agent) or f"gave no answer for {now - heard:.1f} s"
                self._agent_lost(agent, f"at {agent} {why}")
        self.call_later(OWNER_ALIVE_INTERVAL_S, self._send_owner_alive)

    def _refused_by(self, agent: str) -> str | None:
        """Why `agent` refuses this process (its CURVE keys), in words, or None."""
        reason = self.outbox.refusal(agent)
        if reason is None:
            return None
        return (
            f"refused this process: {reason} (wrong or missing CURVE keys: this process uses "
            f"those in {os.environ.get(KEYS_ENV)}; use the keys of the agent's allocation, the "
            f"directory of its --keys, or attach by allocation name)"
        )

    def _on_agent_alive(self, envelope: Envelope) -> None:
        header: AgentAlive = envelope.header
        self._agent_heard[header.agent] = time.monotonic()
        self._silent_agents.discard(header.agent)
        known = self._agent_incarnations.setdefault(header.agent, header.incarnation)
        if known != header.incarnation:
            self._agent_incarnations[header.agent] = header.incarnation
            self._agent_lost(header.agent, "was restarted, and its procs died with the old one")

    def _agent_lost(self, agent: str, why: str) -> None:
        """Every live proc of `agent` failed with kind "unreachable"."""
        self._log.error("agent_lost", agent=agent, reason=why)
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
        for at most RESTART_WAIT_S."""
        with self._lock:
            peer.hold()
            ready = peer.ready
        self.call_later(RESTART_WAIT_S, self._restart_overdue, peer, ready)

    def _restart_overdue(self, peer: ProcPeer, ready: Future[None]) -> None:
        if peer.ready is not ready or ready.finished() or peer.state != "starting":
            return  # it came back (or failed, or was stopped) in time
        self.restarts.cancel(peer)
        message = f"its restart did not complete within {RESTART_WAIT_S} s"
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
        self.host.stop_all()
        self._request_stop()


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
