"""Heartbeats on tcp connections, so that a peer whose host vanished is seen as gone.

A process that dies closes its connections, and its peers notice at once; a host that loses
power or its network, or a process stopped (SIGSTOP, a debugger), closes nothing, and TCP
notices only after minutes. ZMTP heartbeats (zmq's PING and PONG commands, answered by zmq's
own I/O thread, so a busy Python thread does not miss them) end such a connection after
`HEARTBEAT_TIMEOUT_MS` without a word from the peer, which the socket's monitor reports as
a closed connection. Only for tcp: a peer on ipc is on this host, where its death closes it.
"""

from __future__ import annotations

from typing import Any

import zmq

#: How often a connection with no traffic sends a PING.
HEARTBEAT_INTERVAL_MS = 1000
#: How long a connection waits for any traffic after a PING before it is closed (the peer
#: is asked to do the same: ZMQ_HEARTBEAT_TTL).
HEARTBEAT_TIMEOUT_MS = 4000


def send_heartbeats(socket: zmq.Socket[Any]) -> None:
    """Heartbeats on the connections `socket` makes or accepts from now on (zmq copies a
    socket's options into each listener and connection as it is made: a bind or connect
    before this call has none)."""
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
