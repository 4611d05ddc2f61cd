"""Watches on the security handshakes of sockets: why a peer refused us, whom we refused."""

from __future__ import annotations

import contextlib
import errno
import struct
import time
from typing import Any

import zmq

from ._log import get_logger

_REFUSAL_LOG_INTERVAL_S = 10.0
_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_HANDSHAKE_SUCCEEDED = zmq.EVENT_HANDSHAKE_SUCCEEDED
#: How libzmq reports a peer that closed its connection before the handshake ended: an
#: EOF is EPIPE, a reset ECONNRESET.
_HUNG_UP = frozenset({errno.EPIPE, errno.ECONNRESET, errno.ECONNABORTED})
#: A libzmq monitor event's first frame: the event (u16), then its value (an fd, an errno).
_MONITOR_EVENT = struct.Struct("=Hi")


class HandshakeWatch:
    """Remembers why a peer refused an outgoing connection during the security handshake,
    until a later handshake succeeds. Read lazily: the events wait in the monitor socket."""

    def __init__(self, socket: zmq.Socket[Any]) -> None:
        self._socket = socket
        self._monitor = unbounded_monitor(socket, _HANDSHAKE_FAILURES | _HANDSHAKE_SUCCEEDED)
        self._reason: str | None = None
        #: Whether the last handshake seen succeeded (as of the last look at the events).
        self.confirmed = False

    def refusal(self) -> str | None:
        while (found := next_monitor_event(self._monitor)) is not None:
            event, value = found
            self.confirmed = event == _HANDSHAKE_SUCCEEDED
            self._reason = None if self.confirmed else _handshake_failure(event, value)
        return self._reason

    def close(self) -> None:
        """Stop watching. The events waiting unread are taken first: libzmq's "monitor
        stopped" event is a blocking send, which would wait forever on a full queue (a peer
        that refused us a thousand times), and with it this process's exit."""
        with contextlib.suppress(zmq.ZMQError):
            self.refusal()
            self._socket.disable_monitor()
        self._monitor.close(linger=0)


class RefusalWatch:
    """Logs, with a reason, every peer whose connection an inbox refused during the handshake
    (a peer without the allocation's CURVE keys), and apart from those the peers that hung up
    before the handshake ended (a port probe, a peer that stopped): not a key problem.
    Poll `fileno()`, then call `drain()`."""

    def __init__(self, socket: zmq.Socket[Any], address: str) -> None:
        self._monitor = unbounded_monitor(socket, _HANDSHAKE_FAILURES)
        self._address = address
        self._log = get_logger("transport.auth")
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def fileno(self) -> int:
        return int(self._monitor.getsockopt(zmq.FD))

    def drain(self) -> None:
        while (event := next_monitor_event(self._monitor)) is not None:
            hung_up = _peer_hung_up(*event)
            reason = _refused_peer(*event)
            self._count("peer_hung_up" if hung_up else "peer_refused", reason)

    def _count(self, kind: str, reason: str) -> None:
        """Log a failed handshake of `kind`, at most once an interval per kind: a refused
        peer retries every few ms."""
        self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
        now = time.monotonic()
        if now - self._logged_at.get(kind, -_REFUSAL_LOG_INTERVAL_S) < _REFUSAL_LOG_INTERVAL_S:
            return
        self._log.warning(
            kind,
            inbox=self._address,
            handshakes=self._unlogged.pop(kind),
            reason=reason,
        )
        self._logged_at[kind] = now

    def close(self) -> None:
        self._monitor.close(linger=0)


def unbounded_monitor(socket: zmq.Socket[Any], events: int) -> zmq.Socket[Any]:
    """A socket receiving `socket`'s monitor `events`, with no receive limit. libzmq sends
    monitor events from the context's I/O thread with a blocking send: with the default limit,
    a thousand or two unread events (a peer refusing our handshakes for half a minute) would
    stop that thread, and with it every socket of the process. Watches take their events
    whenever they are used (each send, each look at a refusal), so the queue stays short."""
    address = f"inproc://meshvisor-monitor-{id(socket):x}-{socket.FD}"
    socket.monitor(address, events)
    monitor: zmq.Socket[Any] = socket.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.RCVHWM, 0)
    monitor.connect(address)
    return monitor


def next_monitor_event(monitor: zmq.Socket[Any]) -> tuple[int, int] | None:
    """The next (event, value) waiting in `monitor` (a socket from `unbounded_monitor`), or
    None when none waits. Read here rather than with `zmq.utils.monitor`, which imports
    `zmq.asyncio` and all of asyncio into every process (the agent needs neither)."""
    try:
        frames = monitor.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None
    event, value = _MONITOR_EVENT.unpack(frames[0])
    return event, value


def _peer_hung_up(event: int, value: int) -> bool:
    """Whether a failed handshake (a zmq monitor `event` with its `value`) ended because the
    peer closed the connection, rather than because it was told no."""
    return event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and value in _HUNG_UP


def _errno_words(value: int) -> str:
    return f"errno {value}, {errno.errorcode.get(value, 'unknown')}"


def _refused_peer(event: int, value: int) -> str:
    """What a failed handshake means to the listener that saw it."""
    if _peer_hung_up(event, value):
        return (
            f"the peer hung up during the security handshake ({_errno_words(value)}) before "
            "showing any key: a port probe or a peer that went away, not a key mismatch"
        )
    return _handshake_failure(event, value)


def _handshake_failure(event: int, value: int) -> str:
    """What a failed security handshake (a zmq monitor `event` with its `value`) means to the
    side that connected. A CURVE listener that cannot read our keys hangs up without a word,
    so to us its refusal and a listener that went away look the same."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"authentication refused (ZAP status {value}): not this allocation's CURVE key"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return "the security handshake failed: the two sides do not hold the same CURVE keys"
    if _peer_hung_up(event, value):
        return (
            f"the listener hung up during the security handshake ({_errno_words(value)}), as "
            "one does when it holds other CURVE keys than this process"
        )
    return f"the security handshake failed ({_errno_words(value)}): wrong or missing CURVE keys"
