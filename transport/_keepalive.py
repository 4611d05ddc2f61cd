"""Heartbeats on connections, so that a peer whose host vanished, or that is stopped, is seen
as gone.

A process that dies closes its connections, and its peers notice at once; a host that loses
power or its network, or a process stopped (SIGSTOP, a debugger), closes nothing, and TCP
notices only after minutes. ZMTP heartbeats (zmq's PING and PONG commands, answered by zmq's
own I/O thread, so a busy Python thread does not miss them) end such a connection after a
timeout without a word from the peer, which the socket's monitor reports as a closed
connection. The listener chooses the timeout and imposes it on both ends: its PINGs carry it
as their TTL, after which a peer that heard nothing closes the connection too, so a connecting
side needs no setting of its own. On ipc as on tcp: a peer on this host closes its connections
when it dies, but not when it is stopped.
"""

from __future__ import annotations

import math
from typing import Any

import zmq

#: PINGs per timeout: a connection misses a few before it is closed.
_PINGS_PER_TIMEOUT = 4
#: The TTL a PING carries is in tenths of a second, at most 6553.5 s.
_LONGEST_TTL_MS = 0xFFFF * 100


def send_heartbeats(socket: zmq.Socket[Any], timeout_s: float) -> None:
    """Heartbeats on the connections `socket` accepts or makes from now on, closed after
    `timeout_s` without traffic, at this end and at the peer's (zmq copies a socket's options
    into each listener and connection as it is made: a bind or connect before this call has
    none)."""
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(
            f"a heartbeat timeout must be a positive number of seconds, not {timeout_s!r}"
        )
    timeout_ms = min(max(int(timeout_s * 1000), 100), _LONGEST_TTL_MS)
    socket.setsockopt(zmq.HEARTBEAT_IVL, max(timeout_ms // _PINGS_PER_TIMEOUT, 1))
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    socket.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)
