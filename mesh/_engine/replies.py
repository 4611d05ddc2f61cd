"""Reply inboxes: each thread that makes calls receives its own replies, without a hand-off.

A thread blocked in ``Future.get()`` pumps its own reply inbox, so a reply goes from the socket
to the waiting thread directly (no wake-up of the event loop thread, no second thread switch).
Calls made from async code, or from the event loop thread, reply to the runtime's main inbox.
When a thread ends, its inbox is released (once no call still replies there): its socket and
socket file go, and the procs it called drop their connections to it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import sniffio

from mesh._engine.fanout_messages import RelayedReplies
from mesh._engine.fork import check_not_forked
from mesh._engine.future import Future
from mesh._engine.messages import EVERY_CALL, Failure, InboxClosed, Reply, ReplyLost, Wake
from mesh._engine.ownership import Ownership
from mesh._engine.peers import ProcPeer
from mesh._engine.receiver import Receiver
from supervision import SupervisionEvent
from transport import (
    Addresses,
    Envelope,
    LoneInbox,
    Outbox,
    Payload,
    check_fd_headroom,
    get_logger,
    lone_shape,
)

#: How long a thread waits on a future before checking again whether it can pump its inbox.
_RETRY_S = 0.01
#: The longest one blocking receive of a wait with no deadline: a signal (^C, the stop button
#: of a notebook) that lands just before the receive blocks is handled within this long.
_SIGNAL_CHECK_MS = 1000
#: A reply alone in its frame, read as (call id, rank, payload body): no objects built.
_LONE_REPLY = lone_shape(Reply)


class ReplySettler(Protocol):
    """Where replies and failures received on a reply inbox go: the pending calls."""

    def on_reply(self, envelope: Envelope) -> None: ...

    def on_lone_reply(self, call_id: int, rank: int, body: memoryview) -> None: ...

    def on_failure(self, envelope: Envelope) -> None: ...

    def on_relayed(self, envelope: Envelope) -> None: ...

    def inboxes_awaiting_replies(self) -> set[int]: ...

    def fail_lost_reply(self, lost: ReplyLost) -> bool: ...

    def fail_every_lost_reply(self, lost: ReplyLost, home: ReplyInbox | None) -> int: ...


class ReplyHost(Protocol):
    """What reply inboxes need of their process's runtime."""

    @property
    def zmq_context(self) -> Any: ...
    @property
    def pid(self) -> int: ...
    @property
    def proc_id(self) -> str: ...
    @property
    def tcp_host(self) -> str | None: ...
    @property
    def inbox_dir(self) -> str | None: ...
    @property
    def addresses(self) -> Addresses: ...
    @property
    def outbox(self) -> Outbox: ...
    @property
    def ownership(self) -> Ownership: ...
    @property
    def calls(self) -> ReplySettler: ...
    @property
    def receiver(self) -> Receiver | None: ...

    def on_loop_thread(self) -> bool: ...

    def call_soon_threadsafe(self, function: Callable[..., Any], *args: Any) -> None: ...

    def dispatch_elsewhere(self, envelope: Envelope) -> None:
        """Hand a message that is no reply to the event loop thread."""
        ...

    def send_message(self, address: str, header: Any, payload: Payload | None = None) -> None: ...


class ReplyInbox:
    """The reply inbox of one calling thread. Whoever holds `lock` may receive on it."""

    def __init__(self, runtime: ReplyHost, address: str, also: str | None = None) -> None:
        self.runtime = runtime
        self.inbox = LoneInbox(runtime.zmq_context, address, _LONE_REPLY)
        try:
            bound = Addresses.of(self.inbox.address)
            if also is not None:  # tcp beside ipc: peers are handed the one nearest to them
                bound = bound.with_tcp(self.inbox.listen_also(also))
        except BaseException:
            self.inbox.close()
            raise
        self.addresses = bound
        self.address = bound.widest
        self.lock = threading.Lock()
        self.owner = threading.get_ident()  # the thread whose calls reply here
        self.called: set[ProcPeer] = set()  # the procs that may have connected to reply here
        self.closed = False

    def pump_until(self, future: Future[Any], timeout: float | None) -> None:
        """Receive replies until `future` is done or `timeout` passes. (One function, the
        receiving loop inline: it runs once per call waited on.)"""
        runtime = self.runtime
        runtime.outbox.flush()  # what this thread's calls left waiting goes before it waits
        receiver = runtime.receiver
        if receiver is not None:  # a sync call that blocks: the reply may need the inbox
            receiver.step_aside()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.lock.acquire(blocking=False) and not self._acquire(future, deadline):
            return
        try:
            if self.closed:  # its thread ended: nothing comes here, whoever settles it says so
                future.wait_briefly(None if deadline is None else deadline - time.monotonic())
                return
            calls, inbox = runtime.calls, self.inbox
            while not future.finished():  # another holder of the lock may have settled it
                # one blocking receive, no poll before it: a Wake (`wake`) ends it when
                # another thread settles the future (a supervision event, a lost reply)
                wait_ms = _SIGNAL_CHECK_MS
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    wait_ms = max(1, int(min(left * 1000, _SIGNAL_CHECK_MS)))
                got = inbox.receive_lone(wait_ms)
                while got is not None:  # the rest of a batch of replies settles now too, so
                    if isinstance(got, tuple):  # that the get() of each of their futures
                        calls.on_lone_reply(*got)  # returns at once; a lone reply is settled
                    elif type(got.header) is Reply:  # from its ints and body
                        calls.on_reply(got)  # (`_handle`'s first case, inlined)
                    else:
                        self._handle(got)
                    got = inbox.received_lone()
        finally:
            self.lock.release()

    def _acquire(self, future: Future[Any], deadline: float | None) -> bool:
        """Take `lock` from another thread receiving here (it settles what it receives):
        False, not taken, once `future` is done or `deadline` (monotonic) has passed."""
        while True:  # (`pump_until` then asks whether `future` is done)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            if self.lock.acquire(timeout=_RETRY_S):
                return True
            if future.finished():  # settled by the thread that holds the inbox
                return False
            future.wait_briefly(_RETRY_S if remaining is None else min(_RETRY_S, remaining))

    def _handle(self, envelope: Any) -> None:
        kind = type(envelope.header)
        if kind is Reply:
            self.runtime.calls.on_reply(envelope)
        elif kind is Failure:
            self.runtime.calls.on_failure(envelope)
        elif kind is RelayedReplies:
            self.runtime.calls.on_relayed(envelope)
        elif kind is not Wake:
            self.runtime.dispatch_elsewhere(envelope)

    def owned_by_current_thread(self) -> bool:
        return self.owner == threading.get_ident()

    def receive_waiting(self) -> None:
        """Handle the replies that are already here, without waiting (owner thread only)."""
        if not self.lock.acquire(blocking=False):
            return  # the owner is pumping further up its stack
        try:
            while not self.closed and (envelope := self.inbox.receive_nowait()) is not None:
                self._handle(envelope)
        finally:
            self.lock.release()

    def wake(self) -> None:
        """Make a thread blocked on this inbox look at its future again."""
        if not self.closed:
            self.runtime.send_message(self.address, Wake())

    def close(self) -> None:
        with self.lock:
            self._close()

    def close_nowait(self) -> bool:
        """Close it unless some thread is receiving on it right now; whether it closed."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self._close()
        finally:
            self.lock.release()
        return True

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            self.inbox.close()


class _ThreadEnd:
    """Kept in a thread's local storage, so it is dropped when the thread ends: then the
    thread's reply inbox is released."""

    __slots__ = ("inbox", "routes")

    def __init__(self, routes: ReplyRoutes, inbox: ReplyInbox) -> None:
        self.routes = routes
        self.inbox = inbox

    def __del__(self) -> None:
        self.routes.thread_ended(self.inbox)


class ReplyRoutes:
    """Which inbox the replies of a call made on the current thread should go to."""

    def __init__(self, runtime: ReplyHost) -> None:
        self._runtime = runtime
        self._local = threading.local()
        self._all: list[ReplyInbox] = []
        self._ended: deque[ReplyInbox] = deque()  # of threads that ended, not released yet
        self._names = itertools.count()
        self._lock = threading.Lock()

    def for_current_thread(self) -> ReplyInbox | None:
        """This thread's reply inbox, or None when replies should go to the main inbox."""
        runtime = self._runtime
        check_not_forked(runtime.pid)
        found: ReplyInbox | None = getattr(self._local, "inbox", None)
        if (  # the loop thread (which never has an inbox), or a thread running an event loop
            (found is None and runtime.on_loop_thread())  # (asyncio, trio via sniffio)
            or asyncio._get_running_loop() is not None
            or sniffio.current_async_library_cvar.get() is not None
            or sniffio.thread_local.name is not None
        ):
            return None
        tcp = runtime.tcp_host
        if found is None or (tcp is not None and found.addresses.tcp is None):
            self.release_ended()
            alive = sum(1 for peer in runtime.ownership.all_peers() if peer.alive)
            check_fd_headroom(2 + alive, "a reply inbox for this thread's calls")
            with self._lock:
                found = self._new_inbox()
                self._all.append(found)
            self._local.inbox = found
            self._local.end = _ThreadEnd(self, found)  # replaces (so releases) an older one
        return found

    def _new_inbox(self) -> ReplyInbox:
        """A reply inbox listening where its runtime does: on ipc for procs on this host,
        and on tcp too once the runtime reaches other hosts (lock held)."""
        runtime = self._runtime
        tcp = None if runtime.tcp_host is None else f"tcp://{runtime.tcp_host}:*"
        if runtime.inbox_dir is None:  # a proc of a tcp agent: tcp only
            assert tcp is not None
            return ReplyInbox(runtime, tcp)
        ipc = f"ipc://{runtime.inbox_dir}/{runtime.proc_id}-r{next(self._names)}"
        return ReplyInbox(runtime, ipc, also=tcp)

    def thread_ended(self, inbox: ReplyInbox) -> None:
        """`inbox`'s thread has ended (this runs in its last moments): release it soon."""
        self._ended.append(inbox)
        self._runtime.call_soon_threadsafe(self.release_ended)

    def release_ended(self) -> None:
        """Release the inboxes of ended threads, except those that calls still reply to."""
        if not self._ended:
            return
        awaited = self._runtime.calls.inboxes_awaiting_replies()
        kept = []
        while self._ended:
            try:
                inbox = self._ended.popleft()
            except IndexError:  # another thread released the last one
                break
            if id(inbox) in awaited or not self._release(inbox):
                kept.append(inbox)
        self._ended.extend(kept)

    def _release(self, inbox: ReplyInbox) -> bool:
        """Close `inbox` (and its socket file), and have every connection to it dropped."""
        if not inbox.close_nowait():
            return False
        with self._lock:
            if inbox in self._all:
                self._all.remove(inbox)
        runtime = self._runtime
        called = {peer.address for peer in inbox.called if peer.alive and peer.address}
        called |= {peer.agent for peer in inbox.called if peer.agent}  # fanned-out answers
        for mine in inbox.addresses:  # a peer may have been handed either
            runtime.outbox.forget(mine)
            for address in sorted(called):
                runtime.send_message(address, InboxClosed(mine))
        return True

    def on_reply_lost(self, envelope: Envelope) -> None:
        """A proc could not send its answer to a reply address (`ReplyLost`): the call ends
        with an error if this process made it. Another caller (a proc calling an actor owned
        here) is sent that error as the call's `Failure`: this owner may reach it where the
        actor's proc cannot (it holds the keys)."""
        header: ReplyLost = envelope.header
        runtime = self._runtime
        if header.call_id == EVERY_CALL:
            self._every_reply_lost(header)
            return
        if header.reply_to in runtime.addresses or header.reply_to in self.addresses():
            if not runtime.calls.fail_lost_reply(header):
                log = get_logger("mesh.replies")  # not at import: it reads the settings
                log.info("reply_lost", call_id=header.call_id, why="the call has ended")
            return
        try:
            event = envelope.payload.load()  # type: ignore[union-attr]
        except Exception:  # the caller must still hear something
            event = None
        if not isinstance(event, SupervisionEvent):
            why = f"its answer to call {header.call_id} could not be sent: {header.reason}"
            event = SupervisionEvent("unreachable", "", proc_id=header.proc_id, message=why)
        failure = Failure(header.call_id, header.rank, "failed")
        runtime.send_message(header.reply_to, failure, Payload.dump(event))
        log = get_logger("mesh.replies")
        log.info("reply_lost_forwarded", call_id=header.call_id, to=header.reply_to)

    def _every_reply_lost(self, lost: ReplyLost) -> None:
        """Every answer of proc `lost.proc_id` to `lost.reply_to` was refused: each call made
        there that waits on that proc ends; another process's address is sent the report
        (this owner may reach it where the proc cannot), and ends its own calls alike."""
        runtime, log = self._runtime, get_logger("mesh.replies")
        homes: list[ReplyInbox | None]
        with self._lock:
            homes = [inbox for inbox in self._all if lost.reply_to in inbox.addresses]
        if lost.reply_to in runtime.addresses:
            homes = [None]  # its main inbox
        elif not homes:
            runtime.send_message(lost.reply_to, lost, Payload.dump(None))
            log.info("replies_lost_forwarded", proc=lost.proc_id, to=lost.reply_to)
            return
        ended = sum(runtime.calls.fail_every_lost_reply(lost, home) for home in homes)
        log.warning("replies_lost", proc=lost.proc_id, to=lost.reply_to, calls_ended=ended)

    def addresses(self) -> list[str]:
        """Where replies to this process may be sent, besides its main inbox."""
        with self._lock:
            return [address for inbox in self._all for address in inbox.addresses]

    def close(self) -> None:
        with self._lock:
            inboxes, self._all = self._all, []
        for inbox in inboxes:
            inbox.close()
