"""File descriptors: raise the soft limit where allowed, and refuse work that would run out.

libzmq aborts the whole process (SIGABRT, no report) when it cannot get a descriptor for a
connection it accepts. Checking the headroom before spawning procs or opening an inbox turns
that into an error the user can act on.
"""

from __future__ import annotations

import os
import resource

from ._errors import TransportError

#: Descriptors kept free for everything else the program opens (files, logs, zmq's own).
FD_RESERVE = 64
#: The soft limit aimed for when the hard limit is unlimited (Linux's default nr_open).
_UNLIMITED_TARGET = 1 << 20


def raise_open_file_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit (children inherit it);
    where that is not allowed, the limit stays as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        pass


def check_fd_headroom(needed: int, what: str) -> None:
    """Raise TransportError unless `needed` more descriptors fit under the soft limit, with
    `FD_RESERVE` to spare; `what` says what needs them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = _open_fds()
    if soft == resource.RLIM_INFINITY or in_use is None:
        return
    if in_use + needed + FD_RESERVE > soft:
        ceiling = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
        raise TransportError(
            f"too many open files: {what} needs about {needed} more file descriptors, but "
            f"{in_use} of this process's limit of {soft} are in use (and {FD_RESERVE} are kept "
            f"free). Raise the limit with `ulimit -n` (the hard limit is {ceiling}), or use "
            "fewer procs from this process."
        )


def _open_fds() -> int | None:
    """How many descriptors this process has open; None where /proc cannot tell."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # listdir's own descriptor
    except OSError:
        return None
