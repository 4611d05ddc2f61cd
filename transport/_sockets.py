"""Sockets: one bound inbox per process and an outbox that reaches any address.

Every process receives on a single PULL socket (its inbox) and sends through one PUSH socket
per destination, which gives FIFO order per sender→receiver pair. Addresses are zmq endpoint
strings: ``ipc://<private dir>/<name>`` on one host, ``tcp://HOST:PORT`` across hosts. Every
tcp listener and connection is authenticated with the allocation's CURVE keys (see
`_security`); ipc needs none.

Bounds: an inbox takes frames of at most the message size limit plus a header
(``ZMQ_MAXMSGSIZE``: a peer sending a larger one is disconnected) and queues at most
RECEIVE_QUEUE messages per sender (``ZMQ_RCVHWM``). When a receiver falls that far behind,
its senders keep the rest in their own queue (no send high-water mark): nothing is dropped
and no send blocks, and the memory grows in the process that produced the messages, not in
the one that cannot keep up.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.backend

from ._addresses import check_address
from ._batches import BATCH_MAGIC, MAX_BATCH_BYTES, Batch, split_batch_or_none
from ._errors import MalformedMessage, MessageTooLarge, TransportError
from ._faults import network_faults
from ._frames import _PREFIX, MAX_HEADER_BYTES, Envelope, decode
from ._handshakes import HandshakeWatch, RefusalWatch
from ._log import get_logger
from ._security import (
    check_exposure,
    required_keys,
    secure_client,
    secure_server,
)
from ._settings import transport_settings

#: How often a PUSH socket retries connecting to an address nobody has bound yet.
RECONNECT_INTERVAL_MS = 5
#: Messages an inbox queues per sender before that sender's further messages wait with it.
RECEIVE_QUEUE = 1000
# A plain int: pyzmq's enum flags cost an enum construction per use on the receive path.
_NOBLOCK = int(zmq.NOBLOCK)
_BATCH = len(BATCH_MAGIC)
#: The longest wait zmq takes (a C int of milliseconds: about 24 days); a longer one is cut
#: to it, and its caller waits again.
LONGEST_WAIT_MS = (1 << 31) - 1
_zmq_poll = zmq.zmq_poll
#: pyzmq's compiled send, under the Python layer its sockets add (for options unused here).
_send_one_frame = zmq.backend.Socket.send


class Inbox:
    """Where one process receives messages: a PULL socket bound at one address."""

    def __init__(
        self, context: zmq.Context[Any], address: str, *, max_bytes: int | None = None
    ) -> None:
        if max_bytes is None:
            max_bytes = transport_settings().max_message_bytes
        self._socket = context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_bytes + MAX_HEADER_BYTES + _PREFIX)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._max_bytes = max_bytes
        self._log = get_logger("transport.inbox")
        try:
            self._bind(address)
        except TransportError:
            self._socket.close()
            raise
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ipc_path = address[len("ipc://") :] if address.startswith("ipc://") else None
        self._poll_items = [(self._socket, zmq.POLLIN)]
        self._split: deque[Envelope] = deque()  # the messages of a batch not yet taken
        self._polled = False  # the last `poll` saw a message that no receive has taken yet
        self._wait_ms = -1  # RCVTIMEO as set on the socket

    def listen_also(self, address: str) -> str:
        """Also receive on `address` (tcp beside ipc), on its reader thread; the address bound."""
        self._bind(address)
        bound: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        return bound

    def _bind(self, address: str) -> None:
        bind_secured(self._socket, address)

    def watch_refusals(self) -> RefusalWatch:
        """Report peers this inbox refuses (failed handshakes: wrong or missing CURVE keys)."""
        return RefusalWatch(self._socket, self.address)

    def fileno(self) -> int:
        """A file descriptor that becomes readable when messages may be waiting (edge-style)."""
        return int(self._socket.getsockopt(zmq.FD))

    def poll(self, timeout_ms: int | None, wake_fd: int | None = None) -> bool:
        """Wait up to `timeout_ms` (None: forever) for a message, or for `wake_fd` to become
        readable; True if a message may be waiting."""
        if self._split:
            return True
        items = self._poll_items if wake_fd is None else [*self._poll_items, (wake_fd, zmq.POLLIN)]
        ready = _zmq_poll(items, -1 if timeout_ms is None else min(timeout_ms, LONGEST_WAIT_MS))
        # the next receive skips its own poll (two system calls) when this one saw a message
        self._polled = bool(ready) and ready[0][0] is self._socket
        return bool(ready)

    def receive_nowait(self, wait_ms: int = 0) -> Envelope | None:
        """The next valid message, or None when none is waiting. Invalid ones are logged.
        With `wait_ms` (-1: forever), the first receive blocks up to that long: one blocking
        receive costs fewer system calls than a `poll` and a receive after it."""
        if self._split:
            return self._split.popleft()
        socket, ready, polled = self._socket, self._poll_items, self._polled
        self._polled, flags = False, _NOBLOCK
        if wait_ms:
            wait_ms = min(wait_ms, LONGEST_WAIT_MS)  # a longer wait ends early, as None
            if wait_ms != self._wait_ms:  # kept in libzmq: no system call
                socket.setsockopt(zmq.RCVTIMEO, wait_ms)
                self._wait_ms = wait_ms
            polled, flags = True, 0
        # a poll, not `getsockopt(EVENTS)`, which builds an enum (Python code) for its option;
        # and either is cheaper than a receive raising zmq.Again
        while polled or _zmq_poll(ready, 0):
            polled = False
            try:
                frames = [socket.recv(flags, copy=False)]
                flags = _NOBLOCK
                while frames[-1].more:  # the parts of one message arrive together
                    frames.append(socket.recv(_NOBLOCK, copy=False))
            except zmq.Again:
                return None
            except zmq.ZMQError as exc:
                raise TransportError(f"receiving on {self.address} failed: {exc}") from exc
            first = memoryview(frames[0])
            if len(frames) == 1 and first[:_BATCH] == BATCH_MAGIC:  # a batch frame
                self._take_batch(first)
                if self._split:
                    return self._split.popleft()
                continue
            try:
                return decode(frames, max_bytes=self._max_bytes)
            except (MalformedMessage, MessageTooLarge) as exc:
                self._dropped(exc, frames)
        return None

    def _taken(self, frames: list[Any]) -> Envelope | None:
        """The message `frames` hold (a batch's first); None when none is valid (logged).
        `receive_nowait` has this inline: it runs once per message received."""
        first = memoryview(frames[0])
        if len(frames) == 1 and first[:_BATCH] == BATCH_MAGIC:
            self._take_batch(first)
            return self._split.popleft() if self._split else None
        try:
            return decode(frames, max_bytes=self._max_bytes)
        except (MalformedMessage, MessageTooLarge) as exc:
            self._dropped(exc, frames)
            return None

    def receive_received(self) -> Envelope | None:
        """The next message of a batch already received (None if none): no socket call."""
        return self._split.popleft() if self._split else None

    def _take_batch(self, frame: memoryview) -> None:
        """Keep the valid messages of a batch frame to be taken one by one (a plain loop:
        no generator and no call per message)."""
        split, max_bytes = self._split, self._max_bytes
        for message in split_batch_or_none(frame, self._log, self.address):
            try:
                split.append(decode([message], max_bytes=max_bytes))
            except (MalformedMessage, MessageTooLarge) as exc:
                self._dropped(exc, [message])

    def _dropped(self, error: Exception, frames: list[Any]) -> None:
        self._log.warning(
            "message_dropped", address=self.address, reason=str(error), frames=len(frames)
        )

    def close(self) -> None:
        self._socket.close(linger=0)
        if self._ipc_path:
            try:
                os.unlink(self._ipc_path)
            except FileNotFoundError:
                pass


def bind_secured(socket: zmq.Socket[Any], address: str) -> None:
    """Bind `socket` at `address`; a tcp one as a CURVE server (zmq applies the security
    options set at bind time to that listener only, so an ipc binding stays without keys)."""
    if address.startswith("tcp://"):
        check_exposure(address[len("tcp://") :].rsplit(":", 1)[0])
        secure_server(socket, required_keys(address))
    try:
        socket.bind(address)
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot listen on {address}: {exc}") from exc


_FAULTS = network_faults()


class Outbox:
    """Sends frames to any address, FIFO per destination; safe to use from several threads."""

    def __init__(self, context: zmq.Context[Any]) -> None:
        self._context = context
        self._sockets: dict[str, zmq.Socket[Any]] = {}
        self._handshakes: dict[str, HandshakeWatch] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._batches: dict[str, Batch] = {}  # small messages waiting, by destination

    def send(self, address: str, frames: Sequence[Any]) -> None:
        """Queue `frames` for `address`, after what waits in its batch; never blocks on a
        slow or absent receiver."""
        if _FAULTS.active:  # chaos testing: the fault rules decide
            self.flush()
            _FAULTS.route(address, frames, self._send_now)
            return
        with self._lock:  # `_send_now` and `_send_locked` inlined: a call and a reply each
            if self._closed:
                raise TransportError("cannot send: this process's transport is closed.")
            socket = self._sockets.get(address) or self._connect(address)
            batch = self._batches.pop(address, None) if self._batches else None
            if batch is not None:  # what waited goes first: FIFO per destination
                _send_frames(socket, address, [batch.packed()])
            if len(frames) == 1:  # `_send_frames`, inlined: once per message
                try:
                    _send_one_frame(socket, frames[0], _NOBLOCK)
                except zmq.ZMQError as exc:
                    raise _send_error(address, exc) from exc
            else:
                _send_frames(socket, address, frames)
            watch = self._handshakes.get(address) if self._handshakes else None
            if watch is not None:
                watch.refusal()  # takes its waiting events, so that they never pile up

    def send_soon(self, address: str, frames: Sequence[Any]) -> bool:
        """Like `send`, but a small message may wait in `address`'s batch (its receiver is
        busy with earlier ones); True when no batch waited before, so that a `flush` must
        now come soon (the caller arranges it: see `_batches`). An address that cannot be
        connected to (no keys for it, not an address) raises here, as `send` does, not later
        in a flush that has no one to tell."""
        if _FAULTS.active or len(frames) != 1 or len(frames[0]) >= MAX_BATCH_BYTES:  # too big
            self.send(address, frames)
            return False
        with self._lock:
            if self._closed:
                raise TransportError("cannot send: this process's transport is closed.")
            if address not in self._sockets:
                self._connect(address)
            started = not self._batches
            batch = self._batches.get(address)
            if batch is None:
                batch = self._batches[address] = Batch()
            if batch.add(frames[0]):
                del self._batches[address]
                self._send_locked(address, [batch.packed()])
        return started

    def flush(self) -> None:
        """Send every batch that waits (any thread)."""
        if not self._batches:
            return
        with self._lock:
            batches, self._batches = self._batches, {}
            for address, batch in batches.items():
                try:
                    self._send_locked(address, [batch.packed()])
                except TransportError as exc:  # the others must still go
                    get_logger("transport.outbox").warning(
                        "send_failed", to=address, messages=len(batch.frames), reason=str(exc)
                    )

    def _send_now(self, address: str, frames: Sequence[Any]) -> None:
        with self._lock:
            if self._closed:
                raise TransportError("cannot send: this process's transport is closed.")
            batch = self._batches.pop(address, None) if self._batches else None
            if batch is not None:  # what waited goes first: FIFO per destination
                self._send_locked(address, [batch.packed()])
            self._send_locked(address, frames)

    def _send_locked(self, address: str, frames: Sequence[Any]) -> None:
        socket = self._sockets.get(address) or self._connect(address)
        _send_frames(socket, address, frames)
        watch = self._handshakes.get(address)
        if watch is not None:
            watch.refusal()  # takes its waiting events, so that they never pile up

    def send_once(self, address: str, frames: Sequence[Any], linger_ms: int = 1000) -> None:
        """Send `frames` to a passing peer (a viewer) without keeping a connection to it: a
        socket of its own, closed at once; zmq still delivers them for up to `linger_ms`."""
        with self._lock:
            if self._closed:
                raise TransportError("cannot send: this process's transport is closed.")
            socket = self._connect(address, keep=False)
            try:
                _send_frames(socket, address, frames)
            finally:
                socket.close(linger=linger_ms)

    def refusal(self, address: str) -> str | None:
        """Why `address` refused this process's connection during the security handshake
        (wrong or missing CURVE keys), or None if it did not (or is not tcp)."""
        with self._lock:
            watch = self._handshakes.get(address)
            return watch.refusal() if watch is not None else None

    def unconfirmed(self, address: str) -> bool:
        """Whether the kept tcp connection to `address` has not passed a security handshake
        as of its last send: what was sent may wait in zmq for a peer that refuses it (other
        CURVE keys), so its sender looks at `refusal` again later. Cheap: no lock, no I/O."""
        watch = self._handshakes.get(address) if self._handshakes else None
        return watch is not None and not watch.confirmed

    def _connect(self, address: str, keep: bool = True) -> zmq.Socket[Any]:
        """A new PUSH socket connected to `address` (kept for later sends, with a watch of its
        handshakes, if `keep`); closed again if anything fails, since a socket left open makes
        the context's ``term()`` (process exit) wait forever."""
        check_address(address)
        try:
            socket: zmq.Socket[Any] = self._context.socket(zmq.PUSH)
        except zmq.ZMQError as exc:  # EMFILE: no descriptor left for its mailbox
            raise TransportError(f"cannot connect to {address}: {exc}") from exc
        watch = None
        try:
            if address.startswith("tcp://"):  # always authenticated, loopback included
                secure_client(socket, required_keys(address))
                watch = HandshakeWatch(socket) if keep else None
            socket.setsockopt(zmq.SNDHWM, 0)
            socket.setsockopt(zmq.LINGER, 2000)
            socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_INTERVAL_MS)
            socket.connect(address)
        except BaseException as exc:
            if watch is not None:
                watch.close()
            socket.close(linger=0)
            if isinstance(exc, zmq.ZMQError):
                raise TransportError(f"cannot connect to {address}: {exc}") from exc
            raise
        if watch is not None:
            self._handshakes[address] = watch
        if keep:
            self._sockets[address] = socket
        return socket

    def forget(self, address: str) -> None:
        """Drop the connection to a peer known to be gone, with anything still queued for it."""
        with self._lock:
            socket = self._sockets.pop(address, None)
            watch = self._handshakes.pop(address, None)
            self._batches.pop(address, None)
        if watch is not None:
            watch.close()
        if socket is not None:
            socket.close(linger=0)

    def close(self, linger_ms: int = 2000) -> None:
        """Close every connection, waiting up to `linger_ms` for queued messages to leave."""
        with contextlib.suppress(TransportError):
            self.flush()
        with self._lock:
            self._closed = True
            sockets, self._sockets = list(self._sockets.values()), {}
            watches, self._handshakes = list(self._handshakes.values()), {}
        for watch in watches:
            watch.close()
        for socket in sockets:
            socket.close(linger=linger_ms)


def _send_frames(socket: zmq.Socket[Any], address: str, frames: Sequence[Any]) -> None:
    """Queue one message on `socket` (connected to `address`) without blocking."""
    try:
        if len(frames) == 1:
            _send_one_frame(socket, frames[0], _NOBLOCK)  # copying a small frame is cheapest
        else:  # buffers are copied once here, so later changes by the caller (an
            # optimizer step on a tensor just sent) cannot alter what was sent; zmq frames
            # (`Lent` buffers) go without a copy, their owner waits until they are released
            socket.send(frames[0], zmq.NOBLOCK | zmq.SNDMORE)
            socket.send_multipart(frames[1:], zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        raise _send_error(address, exc) from exc


def _send_error(address: str, error: zmq.ZMQError) -> TransportError:
    """What a sender is told when zmq refused to queue its message for `address`."""
    if isinstance(error, zmq.Again):  # only with a send high-water mark, which is unset
        return TransportError(
            f"cannot send to {address}: its send queue is full (the receiver is not "
            "reading); the message was not sent"
        )
    return TransportError(f"cannot send to {address}: {error}")
