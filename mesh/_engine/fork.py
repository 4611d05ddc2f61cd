"""Use from a forked child of the process that owns a runtime fails at once, and clearly.

A forked child inherits the runtime's objects but not its threads, and shares its sockets with
the parent: a call made there would wait forever. The pid is tracked through a fork hook, so
the check costs no system call.
"""

from __future__ import annotations

import os

_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def forked_from(owner_pid: int) -> bool:
    """Whether this process is not `owner_pid` (but a fork of it)."""
    return _pid != owner_pid


def check_not_forked(owner_pid: int) -> None:
    """Raise RuntimeError when this process is a forked child of `owner_pid`."""
    if _pid != owner_pid:
        raise RuntimeError(
            f"meshvisor cannot be used from a forked child (pid {_pid} forked from "
            f"{owner_pid}): the child does not have the parent's meshvisor threads and shares "
            "its sockets. Make calls in the parent, or start child processes with "
            "multiprocessing's 'spawn' or 'forkserver' start method and create meshes there."
        )
