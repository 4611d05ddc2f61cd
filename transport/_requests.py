"""Request/reply sockets: a `Responder` that answers many `Requester`s, each reply to its asker.

For services that answer questions (a key-value store) rather than pass messages on. The
responder is a ROUTER socket bound like an inbox (`bind_secured`: ipc without keys, tcp as a
CURVE server that admits only the allocation's key holders, so nothing from another peer ever
reaches it); a requester is a DEALER socket, one per thread (zmq sockets are not thread-safe),
which also watches its connection: a responder that goes away (its process died) ends a wait
at once (`ResponderGone`) instead of at its timeout. The responder watches its connections
too: `gone_nowait` names the requesters whose connection closed (their process died), so that
what it holds for them (a request waiting for its answer) can be dropped at once. On tcp both
sides send heartbeats (`_keepalive`): a peer whose host vanished, or a process stopped, closes
nothing, and is seen as gone after `HEARTBEAT_TIMEOUT_MS` of silence.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ._addresses import Addresses, check_address
from ._errors import TransportError
from ._handshakes import unbounded_monitor
from ._keepalive import send_heartbeats
from ._security import required_keys, secure_client
from ._sockets import LONGEST_WAIT_MS, bind_secured

_NOBLOCK = int(zmq.NOBLOCK)


class ResponderGone(TransportError):
    """The connection to the responder a requester waited on closed (its process ended), or
    went silent past the heartbeat timeout (its host vanished, or its process was stopped)."""


class Responder:
    """A ROUTER socket bound at ipc `ipc` (and tcp `tcp`, authenticated): requests come with
    the identity of their requester, which `reply` sends the answer to.

    Which requesters went away is known from the socket's monitor: a closed connection is
    reported by its file descriptor, and each request by the descriptor it came through
    (libzmq's ZMQ_SRCFD; ZMQ_ROUTER_NOTIFY, which names the identity, is a draft option)."""

    def __init__(
        self, context: zmq.Context[Any], ipc: str, tcp: str | None, *, max_bytes: int
    ) -> None:
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)  # a larger request: disconnected
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a gone requester: dropped
        self._ipc_path = ipc[len("ipc://") :]
        self._monitor: zmq.Socket[Any] | None = None
        self._on_connection: dict[int, set[bytes]] = {}  # requester identities, by descriptor
        self._gone: set[bytes] = set()
        try:
            self._monitor = unbounded_monitor(self._socket, zmq.EVENT_DISCONNECTED)
            bind_secured(self._socket, ipc)
            bound = Addresses.of(self._socket.getsockopt_string(zmq.LAST_ENDPOINT))
            if tcp is not None:
                send_heartbeats(self._socket)  # on its tcp connections only (bound after)
                bind_secured(self._socket, tcp)
                bound = bound.with_tcp(self._socket.getsockopt_string(zmq.LAST_ENDPOINT))
        except BaseException:
            self.close()
            raise
        self.addresses = bound

    def poll(self, timeout_ms: int, wake_fd: int) -> bool:
        """Wait up to `timeout_ms` for a request, a closed connection or `wake_fd`; True if
        a request or a closed connection waits."""
        items = [(self._socket, zmq.POLLIN), (self._monitor, zmq.POLLIN), (wake_fd, zmq.POLLIN)]
        ready = zmq.zmq_poll(items, min(timeout_ms, LONGEST_WAIT_MS))
        return any(item is not wake_fd for item, _ in ready)

    def gone_nowait(self) -> set[bytes]:
        """The identities of the requesters whose connection closed since the last look."""
        self._take_closed()
        gone, self._gone = self._gone, set()
        return gone

    def receive_nowait(self) -> tuple[bytes, list[bytes]] | None:
        """(requester identity, request frames), or None when no request waits."""
        try:
            frames = self._socket.recv_multipart(_NOBLOCK, copy=False)
        except zmq.Again:
            return None
        # The closing of an earlier connection on the same descriptor is reported before this
        # request could come: taken now, it is not blamed on this requester.
        self._take_closed()
        identity = frames[0].bytes
        self._on_connection.setdefault(frames[0].get(zmq.SRCFD), set()).add(identity)
        return identity, [frame.bytes for frame in frames[1:]]

    def _take_closed(self) -> None:
        """Note the requesters of every connection the monitor reports closed."""
        assert self._monitor is not None
        while True:
            try:
                event = recv_monitor_message(self._monitor, _NOBLOCK)
            except zmq.Again:
                return
            self._gone |= self._on_connection.pop(event["value"], set())

    def reply(self, identity: bytes, frames: Sequence[bytes]) -> None:
        """Answer the requester `identity` (dropped if it is gone)."""
        with contextlib.suppress(zmq.ZMQError):
            self._socket.send_multipart([identity, *frames], _NOBLOCK)

    def close(self) -> None:
        """Close the socket and remove its socket file (from the thread that used it)."""
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._monitor.close(linger=0)
        self._socket.close(linger=0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._ipc_path)


class Requester:
    """A DEALER socket connected to a responder at `address` (one thread uses it)."""

    def __init__(self, context: zmq.Context[Any], address: str, *, max_bytes: int) -> None:
        check_address(address)
        self.address = address
        self._socket = context.socket(zmq.DEALER)
        self._monitor: zmq.Socket[Any] | None = None
        try:
            if address.startswith("tcp://"):
                secure_client(self._socket, required_keys(address))
                send_heartbeats(self._socket)
            self._socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.setsockopt(zmq.IMMEDIATE, 1)  # queued only once connected
            self._monitor = unbounded_monitor(self._socket, zmq.EVENT_DISCONNECTED)
            self._socket.connect(address)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot connect to {address}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def send(self, frames: Sequence[bytes], timeout_ms: int) -> bool:
        """Send a request; False if no connection to the responder opened in `timeout_ms`."""
        try:
            if self._socket.poll(min(timeout_ms, LONGEST_WAIT_MS), zmq.POLLOUT):
                self._socket.send_multipart(frames, _NOBLOCK)
                return True
        except zmq.Again:
            pass
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot send to {self.address}: {exc}") from exc
        return False

    def receive(self, timeout_ms: int) -> list[bytes] | None:
        """The next reply, or None after `timeout_ms`; `ResponderGone` if the connection
        to the responder closed meanwhile."""
        assert self._monitor is not None
        items = [(self._socket, zmq.POLLIN), (self._monitor, zmq.POLLIN)]
        ready = dict(zmq.zmq_poll(items, min(timeout_ms, LONGEST_WAIT_MS)))
        if self._socket in ready:
            frames: list[bytes] = self._socket.recv_multipart(_NOBLOCK)
            return frames
        if self._monitor in ready:
            recv_monitor_message(self._monitor, _NOBLOCK)
            raise ResponderGone(
                f"the connection to {self.address} closed: its process has ended, or it "
                "stopped answering heartbeats (its host is down or unreachable)"
            )
        return None

    def close(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._monitor.close(linger=0)
        self._socket.close(linger=0)
