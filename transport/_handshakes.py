"""Watches on the security handshakes of sockets: why a peer refused us, whom we refused."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ._log import get_logger

_REFUSAL_LOG_INTERVAL_S = 10.0
_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_HANDSHAKE_SUCCEEDED = zmq.EVENT_HANDSHAKE_SUCCEEDED


class HandshakeWatch:
    """Remembers why a peer refused an outgoing connection during the security handshake,
    until a later handshake succeeds. Read lazily: the events wait in the monitor socket."""

    def __init__(self, socket: zmq.Socket[Any]) -> None:
        self._socket = socket
        self._monitor = unbounded_monitor(socket, _HANDSHAKE_FAILURES | _HANDSHAKE_SUCCEEDED)
        self._reason: str | None = None

    def refusal(self) -> str | None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return self._reason
            if event["event"] == _HANDSHAKE_SUCCEEDED:
                self._reason = None
            else:
                self._reason = _handshake_failure(event["event"], event["value"])

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
    (a peer without the allocation's CURVE keys). Poll `fileno()`, then call `drain()`."""

    def __init__(self, socket: zmq.Socket[Any], address: str) -> None:
        self._monitor = unbounded_monitor(socket, _HANDSHAKE_FAILURES)
        self._address = address
        self._log = get_logger("transport.auth")
        self._logged_at = -_REFUSAL_LOG_INTERVAL_S
        self._unlogged = 0

    def fileno(self) -> int:
        return int(self._monitor.getsockopt(zmq.FD))

    def drain(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._unlogged += 1
            now = time.monotonic()
            if now - self._logged_at < _REFUSAL_LOG_INTERVAL_S:
                continue  # a refused peer retries every few ms: one line per interval
            self._log.warning(
                "peer_refused",
                inbox=self._address,
                refusals=self._unlogged,
                reason=_handshake_failure(event["event"], event["value"]),
            )
            self._logged_at, self._unlogged = now, 0

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


def _handshake_failure(event: int, value: int) -> str:
    """What a failed security handshake (a zmq monitor `event` with its `value`) means."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"authentication refused (ZAP status {value}): not this allocation's CURVE key"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return "the security handshake failed: the two sides do not hold the same CURVE keys"
    return f"the security handshake failed (errno {value}): wrong or missing CURVE keys"
