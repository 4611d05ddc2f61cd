"""zmq contexts: one per process, made fresh (never shared across fork) and closed within a
bound, since a socket left open would make closing wait forever; and tcp addresses to bind."""

from __future__ import annotations

import threading
from typing import Any

import zmq

from ._log import get_logger
from ._security import stop_authenticator


def new_context() -> zmq.Context[Any]:
    """A fresh zmq context for this process (never share one across fork)."""
    return zmq.Context(io_threads=1)


#: How long closing a context waits for its last messages to leave before giving up on them.
CONTEXT_TERM_S = 5.0


def close_context(context: zmq.Context[Any]) -> None:
    """Terminate a context made by `new_context` (its sockets must be closed). Bounded: a
    socket still open somewhere would make ``term()`` wait forever, and with it the exit of
    this process, so after `CONTEXT_TERM_S` it is left to the end of the process, logged."""
    stop_authenticator(context)
    term = threading.Thread(target=context.term, name="meshvisor-context-term", daemon=True)
    term.start()
    term.join(CONTEXT_TERM_S)
    if term.is_alive():
        get_logger("transport.context").warning(
            "context_left_open",
            reason=f"a socket was still open after {CONTEXT_TERM_S:g} s; its messages are lost",
        )


def tcp_address(host: str = "127.0.0.1", port: int = 0) -> str:
    """A tcp address; port 0 lets the inbox pick a free port when it binds."""
    return f"tcp://{host}:{port if port else '*'}"
