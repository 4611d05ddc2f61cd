"""A clean exit for a replica's proc with gloo calls still in flight on its threads.

A thread that waits in a gloo call (a rendezvous given up, a collective waited on in slices)
has released the GIL. If the interpreter finalizes meanwhile, that thread is ended as it takes
the GIL back, inside a C++ destructor: the process dies by ``std::terminate`` (SIGABRT,
"terminate called without an active exception") instead of exiting. So at exit the waits are
told to give up (they do within a poll), and if a call still has not returned after
`EXIT_WAIT_S` (a rendezvous blocks until the store's timeout), the proc leaves anyway.

A meshvisor proc that made gloo calls (stopped gracefully: its exit code is 0) then leaves
with ``os._exit`` once the other exit handlers ran and its streams are flushed: finalizing the
interpreter would also destroy its process groups, whose peers may be dead (their destructors
wait for pending work), and gloo's C++ state, which can end in ``std::terminate`` too. Any
other process waits for its calls to end (their timeouts bound them) and exits normally, so
that its own exit code stands.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator

from mesh import context

from ._outcomes import ExchangeAborted

#: How long the exit waits for gloo calls in flight to return before leaving without them.
EXIT_WAIT_S = 1.0

_changed = threading.Condition()
_in_flight = 0
_leaving = False
_in_proc = False  # a call was made by an actor: this process is a meshvisor proc


def leaving() -> bool:
    """Whether the interpreter is exiting: a wait in a gloo call should give up."""
    return _leaving


@contextlib.contextmanager
def native_call() -> Iterator[None]:
    """Count the calling thread as inside a gloo call (GIL released) while the block runs;
    `ExchangeAborted` instead once the exit began (a thread entering gloo after the exit
    handler ran would be caught there by the interpreter's finalization)."""
    global _in_flight, _in_proc
    in_proc = context().proc_id != "client"
    with _changed:
        if _leaving:
            raise ExchangeAborted("the exchange was given up: the process is exiting")
        _in_proc = _in_proc or in_proc
        _in_flight += 1
    try:
        yield
    finally:
        with _changed:
            _in_flight -= 1
            _changed.notify_all()


def _exit_cleanly() -> None:
    """At exit: let the waits give up (see the module docstring); a proc then leaves."""
    global _leaving
    deadline = time.monotonic() + EXIT_WAIT_S
    with _changed:
        _leaving = True
        while _in_flight and (not _in_proc or time.monotonic() < deadline):
            _changed.wait(max(0.0, deadline - time.monotonic()) if _in_proc else None)
        if not _in_proc:
            return
    atexit.unregister(_exit_cleanly)
    atexit._run_exitfuncs()  # those registered before this one: they still run
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)  # a proc finalizes only after a graceful stop; a failing one leaves earlier


# At import, not at the first call: a thread about to make its first call while the process
# exits must find the exit begun (it then refuses), not a handler registered too late to run.
atexit.register(_exit_cleanly)
