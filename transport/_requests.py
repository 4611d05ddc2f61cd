"""Request/reply sockets: a `Responder` that answers many `Requester`s, each reply to its asker.

For services that answer questions (a key-value store) rather than pass messages on. The
responder is a ROUTER socket bound like an inbox (`bind_secured`: ipc without keys, tcp as a
CURVE server that admits only the allocation's key holders, so nothing from another peer ever
reaches it); a requester is a DEALER socket, one per thread (zmq sockets are not thread-safe),
which also watches its connection: a responder that goes away (its process died) ends a wait at
once (`ResponderGone`) instead of at its timeout. The responder watches its connections too:
`gone_nowait` names the requesters whose connection closed (their process died), so that what it
holds for them (a request waiting for its answer) can be dropped at once. On ipc and tcp alike
the responder sends heartbeats (`_keepalive`), whose timeout it imposes on both ends: a peer
whose host vanished, or a process stopped (on this host too), closes nothing, and is seen as
gone after that much silence. A requester whose responder ended while it was idle learns it from
its next call at once: its attempts to connect again are refused. A requester keeps its routing
id across connections (`Requester.reconnect`), and the responder hands that id over to the
newest connection, so that a requester back from a pause gets its answers, and the closing of
its old connection is not taken for its going away.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

import zmq

from ._addresses import Addresses, check_address
from ._errors import TransportError
from ._handshakes import next_monitor_event, unbounded_monitor
from ._keepalive import send_heartbeats
from ._security import required_keys, secure_client
from ._sockets import LONGEST_WAIT_MS, bind_secured

_NOBLOCK = int(zmq.NOBLOCK)


class ResponderGone(TransportError):
    """The connection to the responder a requester waited on closed (its process ended), or
    went silent past the heartbeat timeout (its host vanished, or its process was stopped)."""


class Responder:
    """A ROUTER socket bound at ipc `ipc` (and tcp `tcp`, authenticated), its connections
    closed after `heartbeat_timeout_s` of silence: requests come with the identity of their
    requester, which `reply` sends the answer to.

    Which requesters went away is known from the socket's monitor: a closed connection is
    reported by its file descriptor, and each request by the descriptor it came through
    (libzmq's ZMQ_SRCFD; ZMQ_ROUTER_NOTIFY, which names the identity, is a draft option)."""

    def __init__(
        self,
        context: zmq.Context[Any],
        ipc: str,
        tcp: str | None,
        *,
        max_bytes: int,
        heartbeat_timeout_s: float,
    ) -> None:
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a requester's id goes to its newest
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)  # a larger request: disconnected
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a gone requester: dropped
        self._ipc_path = ipc[len("ipc://") :]
        self._monitor: zmq.Socket[Any] | None = None
        self._on_connection: dict[int, set[bytes]] = {}  # requester identities, by descriptor
        self._connection_of: dict[bytes, int] = {}  # the newest descriptor of each identity
        self._gone: set[bytes] = set()
        try:
            self._monitor = unbounded_monitor(self._socket, zmq.EVENT_DISCONNECTED)
            send_heartbeats(self._socket, heartbeat_timeout_s)  # before its binds: on both
            bind_secured(self._socket, ipc)
            bound = Addresses.of(self._socket.getsockopt_string(zmq.LAST_ENDPOINT))
            if tcp is not None:
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
        identity, descriptor = frames[0].bytes, frames[0].get(zmq.SRCFD)
        self._on_connection.setdefault(descriptor, set()).add(identity)
        self._connection_of[identity] = descriptor
        return identity, [frame.bytes for frame in frames[1:]]

    def _take_closed(self) -> None:
        """Note the requesters of every connection the monitor reports closed (not those
        that asked through a newer connection since: they came back)."""
        assert self._monitor is not None
        while (event := next_monitor_event(self._monitor)) is not None:
            closed = event[1]  # the descriptor of the connection
            for identity in self._on_connection.pop(closed, set()):
                if self._connection_of.get(identity) == closed:
                    del self._connection_of[identity]
                    self._gone.add(identity)

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
    """A DEALER socket connected to a responder at `address` (one thread uses it), under a
    routing id of its own that outlives its connections: after `reconnect`, the responder
    sends the answers of this requester's requests down the new connection."""

    def __init__(self, context: zmq.Context[Any], address: str, *, max_bytes: int) -> None:
        check_address(address)
        self.address = address
        self._context = context
        self._max_bytes = max_bytes
        self._routing_id = b"R" + os.urandom(15)  # never starts with 0: zmq reserves that
        self._socket, self._monitor = self._open()

    def _open(self) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
        """A socket connecting to the responder, and the monitor of its connections (closed,
        and connection attempts that failed)."""
        socket = self._context.socket(zmq.DEALER)
        monitor: zmq.Socket[Any] | None = None
        try:
            if self.address.startswith("tcp://"):  # (heartbeats: the responder imposes them)
                secure_client(socket, required_keys(self.address))
            socket.setsockopt(zmq.ROUTING_ID, self._routing_id)
            socket.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.IMMEDIATE, 1)  # queued only once connected
            monitor = unbounded_monitor(socket, zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
            socket.connect(self.address)
        except BaseException as exc:
            _close(socket, monitor)
            if isinstance(exc, zmq.ZMQError):
                raise TransportError(f"cannot connect to {self.address}: {exc}") from exc
            raise
        return socket, monitor

    def send(self, frames: Sequence[bytes], timeout_ms: int) -> bool:
        """Send a request; False if no connection to the responder opened in `timeout_ms`;
        `ResponderGone` at once if an attempt to connect was refused since the last call (the
        responder's process ended while this requester was idle), without waiting that long.
        Connections that closed before are forgotten: the request goes down the open one."""
        try:
            if self._wait_connected(timeout_ms, zmq.EVENT_CLOSED in self._events()):
                self._socket.send_multipart(frames, _NOBLOCK)
                return True
        except zmq.Again:
            pass
        except zmq.ZMQError as exc:
            raise TransportError(f"cannot send to {self.address}: {exc}") from exc
        return False

    def reconnect(self, timeout_ms: int) -> bool:
        """After `ResponderGone`: connect again on a new socket (a new handshake; a request
        sent down the old one is lost with it), and wait up to `timeout_ms` for the connection.
        False if none opened in time (a responder stopped, a host out of reach); raises
        `ResponderGone` if nothing listens there any more (its process ended)."""
        _close(self._socket, self._monitor)
        self._socket, self._monitor = self._open()
        return self._wait_connected(timeout_ms, refused=False)

    def _wait_connected(self, timeout_ms: int, refused: bool) -> bool:
        """Wait up to `timeout_ms` for an open connection; False if none opened. A refused
        attempt to connect (zmq's "closed" event of a connecting socket: a port or ipc file
        nothing listens at), before (`refused`) or meanwhile, raises `ResponderGone`."""
        items = [(self._socket, zmq.POLLOUT), (self._monitor, zmq.POLLIN)]
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            left_ms = 0 if refused else max(0, int((deadline - time.monotonic()) * 1000) + 1)
            ready = dict(zmq.zmq_poll(items, min(left_ms, LONGEST_WAIT_MS)))
            if self._socket in ready:
                return True
            if refused or zmq.EVENT_CLOSED in self._events():
                raise ResponderGone(
                    f"nothing listens at {self.address} any more: its process has ended"
                )
            if time.monotonic() >= deadline:
                return False

    def receive(self, timeout_ms: int) -> list[bytes] | None:
        """The next reply, or None after `timeout_ms`; `ResponderGone` if the connection
        to the responder closed meanwhile."""
        items = [(self._socket, zmq.POLLIN), (self._monitor, zmq.POLLIN)]
        ready = dict(zmq.zmq_poll(items, min(timeout_ms, LONGEST_WAIT_MS)))
        if self._socket in ready:
            frames: list[bytes] = self._socket.recv_multipart(_NOBLOCK)
            return frames
        if self._monitor in ready and zmq.EVENT_DISCONNECTED in self._events():
            raise ResponderGone(
                f"the connection to {self.address} closed: its process has ended, or it "
                "stopped answering heartbeats (it is stopped, or its host is down or "
                "unreachable)"
            )
        return None

    def _events(self) -> set[int]:
        """The kinds of the monitor's events that wait, taken."""
        kinds = set()
        while (event := next_monitor_event(self._monitor)) is not None:
            kinds.add(event[0])
        return kinds

    def close(self) -> None:
        _close(self._socket, self._monitor)


def _close(socket: zmq.Socket[Any], monitor: zmq.Socket[Any] | None) -> None:
    """Close `socket` and its `monitor`, if it has one yet."""
    if monitor is not None:
        with contextlib.suppress(zmq.ZMQError):
            socket.disable_monitor()
        monitor.close(linger=0)
    socket.close(linger=0)
