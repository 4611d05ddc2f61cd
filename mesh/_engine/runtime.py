"""`Runtime`: one per process (the client or a proc); puts the engine's parts together.

The parts, each in its own module: the event loop (`EventLoop`), the calls awaiting replies
(`CallTable`) and the threads' reply inboxes (`ReplyRoutes`), the registry of procs, meshes,
owners and handlers (`Ownership`), the procs' lifecycle (`ProcLifecycle`), the watch on host
agents (`AgentWatch`), supervision (`Supervisor`), restarts (`Restarts`), and the actors this
process runs (`ActorHost`). Each message is dispatched by its type to one of them.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from mesh._engine.agent_queries import AgentQueries
from mesh._engine.agents import AgentWatch
from mesh._engine.calltable import CallTable
from mesh._engine.debug_pause import PausedCalls
from mesh._engine.fanout_messages import RelayedReplies
from mesh._engine.fault_rules import apply_fault_rules
from mesh._engine.future import Future
from mesh._engine.host import ActorHost
from mesh._engine.log_messages import OutputSynced, ProcOutput, SetProcLogLevel
from mesh._engine.loop import EventLoop
from mesh._engine.messages import (
    ActorFailed,
    AgentAlive,
    Failure,
    InboxClosed,
    PortHeld,
    PortMessage,
    PreemptionNotice,
    ProcExited,
    ProcReady,
    ProcReplaced,
    ReceiverAddresses,
    Relay,
    Reply,
    ReplyLost,
    SetFaultRules,
    SpawnFailed,
    StopProc,
    Wake,
)
from mesh._engine.ownership import Ownership
from mesh._engine.peers import ProcPeer
from mesh._engine.ports import PortTable
from mesh._engine.proc_output import OutputSink
from mesh._engine.procs import ProcLifecycle
from mesh._engine.reader_calls import InboxReading, ReaderCalls
from mesh._engine.receiver import Receiver
from mesh._engine.relays import Relays
from mesh._engine.replies import ReplyInbox, ReplyRoutes
from mesh._engine.restarts import Restarts
from mesh._engine.supervisor import Supervisor
from mesh._settings import Settings, current_settings
from supervision import SupervisionEvent
from transport import (
    Addresses,
    Envelope,
    Flusher,
    KeyedInbox,
    Outbox,
    Payload,
    TransportError,
    close_context,
    configured_keys,
    encode,
    get_logger,
    host_towards,
    new_context,
)

#: Held while a runtime binds its inbox on tcp (`Runtime.listen_on_tcp`; no wait inside).
_LISTENING = threading.Lock()
#: The longest a message waits in a batch for others to the same address (`Outbox.send_soon`).
BATCH_DELAY_S = 0.001


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
        self.hostname = self.settings.host_name
        self.pid = os.getpid()
        self.zmq_context = new_context()
        self.inbox = KeyedInbox(self.zmq_context, address)
        self.outbox = Outbox(self.zmq_context)
        self._flusher = Flusher(self.outbox.flush, BATCH_DELAY_S, "meshvisor-flusher")
        self.addresses = Addresses.of(self.inbox.address)
        #: Its widest address, for a receiver not known when it is handed out (a `Port`, a
        #: proc's own `ProcReady`); `address_for` when the receiver is known.
        self.address = self.addresses.widest
        #: Whether peers are handed the address nearest to them (`address_for`); tests turn
        #: it off to play a sender that hands out its tcp address to all.
        self.nearest_addresses = True
        self.inbox_dir = os.path.dirname(address[6:]) if address.startswith("ipc://") else None
        self.tcp_host = _tcp_host(self.inbox.address)
        self.closing = False  # set while the session shuts down: exits are expected then
        self.closed = threading.Event()
        self._log = get_logger("mesh.runtime", proc=proc_id)
        self.loop = EventLoop(self.inbox, self._dispatch, self.pid, self.outbox.flush)
        #: Whether this thread is the event loop's: the loop's own check, asked on every call
        #: and every wait (no method of the runtime's own in between).
        self.on_loop_thread: Callable[[], bool] = self.loop.on_loop_thread
        self.ownership = Ownership()
        self.calls = CallTable(self.ownership.lock, self.outbox, self.pid, self._flush_soon)
        self.replies = ReplyRoutes(self)
        self.host = ActorHost(self)
        self.ports = PortTable(self)
        self.relays = Relays(self)
        self.supervisor = Supervisor(
            self.ownership, self.host.supervise, proc_id=proc_id, is_root=is_root
        )
        self.restarts = Restarts(self, self.calls, self.ownership, self.supervisor, proc_id)
        self.procs = ProcLifecycle(
            self, self.ownership, self.calls, self.supervisor, self.restarts, proc_id
        )
        self.agents = AgentWatch(self, self.loop, self.procs.fail_procs_of, proc_id)
        self.output = OutputSink(self, self.ownership)
        self.paused_calls = PausedCalls(self)  # breakpoint() in a proc (installed by proc_main)
        self.receiver: Receiver | None = None  # a proc's (receive_on_workers)
        #: Binds of the inbox, run where no other thread reads it (zmq is not thread-safe).
        self._wake_inbox = functools.partial(self.send_message, self.inbox.address, Wake())
        self.reader_calls = ReaderCalls(self._wake_inbox)
        self._handlers: dict[type, Callable[[Envelope], None]] = {
            Reply: self.calls.on_reply,
            Failure: self.calls.on_failure,
            ReplyLost: self.replies.on_reply_lost,
            RelayedReplies: self.calls.on_relayed,
            ProcReady: self.procs.on_proc_ready,
            ProcExited: self.procs.on_proc_exited,
            SpawnFailed: self.procs.on_spawn_failed,
            ActorFailed: self.procs.on_actor_failed,
            StopProc: self._on_stop_proc,
            AgentAlive: self.agents.on_agent_alive,
            ProcReplaced: self.procs.on_proc_replaced,
            PreemptionNotice: self.supervisor.on_notice,
            SetFaultRules: apply_fault_rules,
            InboxClosed: functools.partial(_forget_inbox, self.outbox),
            PortMessage: self.ports.on_message,
            PortHeld: self.ports.on_held,
            ReceiverAddresses: self.ports.on_receiver_addresses,
            Relay: self.relays.on_relay,
            ProcOutput: self.output.on_output,
            OutputSynced: self.output.on_synced,
            SetProcLogLevel: _set_log_level,
            Wake: functools.partial(_run_waiting, self.reader_calls),
            **self.host.message_handlers(),
            **self.paused_calls.message_handlers(),
        }
        self.queries = AgentQueries(self, self._handlers)

    # -- the event loop ------------------------------------------------------------------------

    def run(self) -> None:
        """Run the event loop on this thread until `stop_loop` (or a StopProc message)."""
        self.loop.run()

    def start_in_thread(self) -> None:
        self.loop.start_in_thread()

    def receive_on_workers(self) -> None:
        """A proc: worker threads read the inbox and run sync calls themselves (`Receiver`);
        call before `run`."""
        direct = {kind: self._handlers[kind] for kind in self.host.message_handlers()}
        # in order with the calls after it: one of them may pass on a port of that receiver
        direct[ReceiverAddresses] = self.ports.on_receiver_addresses
        flush = self.outbox.flush
        wake = self._wake_inbox
        lone = self.host.lone_calls
        self.inbox.key_with(lone.shape, lone.routes)
        receiver = Receiver(self.inbox, self.host.workers, self.loop, direct, lone, flush, wake)
        receiver.on_wake = self.reader_calls.run_waiting  # a bind other threads asked
        self.loop.read_with(receiver)
        self.receiver = receiver

    def stop_loop(self) -> None:
        """Ask the event loop to finish (from any thread) and wait for it."""
        self.loop.stop()

    def _dispatch(self, envelope: Envelope) -> None:
        kind = type(envelope.header)
        try:
            handler = self._handlers.get(kind)
            if handler is None:
                self._log.warning(
                    "message_ignored", kind=kind.__name__, reason="this process does not handle it"
                )
                return
            handler(envelope)
        except Exception:  # not cancellation (a BaseException); also on a receiver thread
            self._log.exception("message_handling_failed", kind=kind.__name__)

    def dispatch_elsewhere(self, envelope: Envelope) -> None:
        """Hand a message received off the loop thread to the loop thread."""
        self.loop.dispatch_elsewhere(envelope)

    def pump_until(self, future: Future[Any], timeout: float | None) -> None:
        """Receive and dispatch on this (loop) thread until `future` is done or time is up."""
        self.loop.pump_until(future, timeout)

    def call_soon(self, function: Callable[..., Any], *args: Any) -> None:
        """Run `function(*args)` on the loop thread soon, from any thread (loop's context)."""
        self.loop.call_soon(function, *args)

    def call_later(self, delay_s: float, function: Callable[..., Any], *args: Any) -> None:
        """Run `function(*args)` on the loop thread after `delay_s` (loop thread only)."""
        self.loop.call_later(delay_s, function, *args)

    def call_soon_threadsafe(self, function: Callable[..., Any], *args: Any) -> None:
        """Run `function(*args)` soon on the loop thread, from any thread."""
        self.loop.call_soon_threadsafe(function, *args)

    def start_task(self, function: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start a task on the event loop (loop thread only)."""
        self.loop.start_task(function, *args)

    def close(self) -> None:
        self.output.close()  # lines still aggregated are printed first
        self.closed.set()
        self.replies.close()
        self.reader_calls.close()
        self._flusher.stop()
        self.outbox.close(linger_ms=500)
        self.inbox.close()
        close_context(self.zmq_context)

    # -- sending -------------------------------------------------------------------------------

    def send_message(self, address: str, header: Any, payload: Payload | None = None) -> None:
        """Send one message; an unreachable address is logged, never raised to a handler."""
        try:
            frames = encode(header, payload)
        except TransportError as exc:
            self._send_failed(address, type(header), exc)
            return
        self.send_frames(address, type(header), frames)

    def send_frames(
        self, address: str, kind: type, frames: list[Any], *, soon: bool = False
    ) -> TransportError | None:
        """Send the frames `encode` made for a header of type `kind`; an unreachable address
        is logged and returned as the error (never raised). `soon`: they may wait in a batch
        for a moment (`transport._batches`)."""
        try:
            if not soon:
                self.outbox.send(address, frames)
            elif self.outbox.send_soon(address, frames):
                self._flush_soon()
        except TransportError as exc:
            self._send_failed(address, kind, exc)
            return exc
        return None

    def _send_failed(self, address: str, kind: type, error: TransportError) -> None:
        """Log a message that could not leave: a warning, unless this process is closing (a
        call that ends after its proc's transport closed: its caller hears of the stop)."""
        log = self._log.debug if self.closing else self._log.warning
        log("send_failed", to=address, kind=kind.__name__, reason=str(error))

    def _flush_soon(self) -> None:
        """Send the waiting batches after the event loop's current turn when sent from it
        (async code batches what its tasks send in one turn), else within BATCH_DELAY_S
        (the flusher thread's next tick: no wake-up of the event loop)."""
        loop = self.loop
        if loop.on_loop_thread():
            loop.call_soon(self.outbox.flush)
        else:
            self._flusher.soon()

    def address_for(self, peer: str | None, home: ReplyInbox | None = None) -> str:
        """The address of this process (or of the reply inbox `home`) to hand to the
        process at `peer` (its address, or its host agent's): ipc for a peer on this host,
        which may hold no keys, tcp for the others (`Addresses.nearest_for`)."""
        addresses = self.addresses if home is None else home.addresses
        return addresses.nearest_for(peer) if self.nearest_addresses else addresses.widest

    def listen_on_tcp(self, host: str) -> None:
        """Also listen on tcp (for procs on other hosts): peers there are handed it. Once,
        whichever threads ask (a proc's workers adopting handles at the same time); the bind
        runs where no other thread reads the inbox (`reader_calls.py`)."""
        if self.tcp_host is not None:
            return
        reading: InboxReading = self.receiver if self.receiver is not None else self.loop
        what = f"listen on tcp://{host}"
        if self.reader_calls.call(reading, functools.partial(_bind_tcp, self, host), what):
            self.ports.listens_on_tcp()  # ports handed out before carry ipc only

    # -- procs -----------------------------------------------------------------------------------

    def check_agent(self, agent: str) -> None:
        """Procs were just requested from `agent`: fail them if it is known to be gone."""
        self.agents.check_agent(agent)

    def agent_lost(self, agent: str) -> bool:
        """Whether host agent `agent` is lost (died, or silent)."""
        return self.agents.is_lost(agent)

    def mark_peer_gone(self, peer: ProcPeer, event: SupervisionEvent, state: str) -> None:
        """Record that `peer` is gone and fail every call still waiting on it."""
        self.procs.mark_peer_gone(peer, event, state)

    def stop_peers(self, peers: list[ProcPeer], grace_s: float, why: str = "by its owner") -> None:
        """Stop these procs on purpose; their exit is reported as "stopped"."""
        self.procs.stop_peers(peers, grace_s, why)

    def stop_owned_by(self, actor_id: str, grace_s: float = 5.0) -> None:
        """Stop every proc that actor `actor_id` spawned (a mesh never outlives its owner)."""
        self.procs.stop_owned_by(actor_id, grace_s)

    def _on_stop_proc(self, envelope: Envelope) -> None:
        if self.supervisor.is_root:  # only procs are stopped by their agent; a client ends itself
            self._log.warning("message_ignored", kind="StopProc", reason="the client has no agent")
            return
        self.host.stop_all(then=lambda: self.call_soon(self.loop.request_stop))


def listen_towards(runtime: Runtime, peer: str | None) -> None:
    """Procs at `peer` (an address) will answer `runtime`'s process: when they are reached
    over tcp and it listens on ipc only, it listens on tcp too (with the keys it reaches them
    with), so that their answers arrive from another host instead of waiting in zmq for a
    socket file that is not there. Threads' next calls get reply inboxes on tcp too."""
    tcp_peer = runtime.tcp_host is None and peer is not None and peer.startswith("tcp://")
    if tcp_peer and configured_keys() is not None:  # no keys: sending there says so
        assert peer is not None
        runtime.listen_on_tcp(host_towards(peer))


def _bind_tcp(runtime: Runtime, host: str) -> bool:
    """Bind `runtime`'s inbox on tcp at `host` unless it is already; whether it was bound now
    (on the thread that reads the inbox, or while none does: `Runtime.listen_on_tcp`)."""
    with _LISTENING:
        if runtime.tcp_host is not None:
            return False
        if runtime.closed.is_set():
            raise TransportError(f"cannot listen on tcp://{host}: this process has closed.")
        tcp = runtime.inbox.listen_also(f"tcp://{host}:*")
        runtime.addresses = runtime.addresses.with_tcp(tcp)
        runtime.address = runtime.addresses.widest
        runtime.tcp_host = host
    return True


def _run_waiting(calls: ReaderCalls, envelope: Envelope) -> None:
    """A `Wake` on the inbox: run what other threads asked of its reader (this thread)."""
    calls.run_waiting()


def _forget_inbox(outbox: Outbox, envelope: Envelope) -> None:
    """A caller's reply inbox is gone (`InboxClosed`): drop the connection made to answer it."""
    outbox.forget(envelope.header.address)


def _set_log_level(envelope: Envelope) -> None:
    """This proc's root `logging` level, as its owner set it (`ProcMesh.logging_option`)."""
    logging.getLogger().setLevel(envelope.header.level)


def _tcp_host(address: str) -> str | None:
    """The host part of a tcp address, None for other transports."""
    if not address.startswith("tcp://"):
        return None
    return address[len("tcp://") :].rsplit(":", 1)[0]
