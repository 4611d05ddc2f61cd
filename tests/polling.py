"""Waiting for conditions with a deadline (never a bare sleep), and looking at processes."""

from __future__ import annotations

import time
from collections.abc import Callable

DEFAULT_TIMEOUT_S = 30.0


def wait_until(
    condition: Callable[[], object], timeout: float = DEFAULT_TIMEOUT_S, what: str = "condition"
) -> None:
    """Poll `condition` until it is truthy; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    wait_until(
        lambda: not any(pid_alive(p) for p in pids),
        timeout,
        f"processes {[p for p in pids if pid_alive(p)]} to exit",
    )
