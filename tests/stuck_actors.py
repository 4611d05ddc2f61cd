"""Actors whose calls get stuck where heartbeats cannot see it: a lock, a queue, an event.

Each waiting endpoint first creates ``<marker>`` (when given), so a test knows the call began.
`StuckByClass` sets a class-wide `call_limit_s`; the endpoints' own limits override it.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from typing import Any

import anyio

from mesh import Actor, concurrent_endpoint, context, endpoint
from mesh.testing import call_watchdog_suspended

#: The limit the tests give: short, so that they end soon; the slack is in their waits.
LIMIT_S = 1.0


def _began(marker: str | None) -> None:
    if marker:
        with open(marker, "w"):
            pass


class Stuck(Actor):
    """Endpoints that wait forever (for nothing that ever comes), and some that do not."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    @endpoint(call_limit_s=LIMIT_S)
    def wait_on_lock(self, marker: str | None = None) -> None:
        _began(marker)
        with self.lock:
            self.lock.acquire()  # a deadlock: the lock is ours already

    @endpoint(call_limit_s=LIMIT_S)
    def wait_on_queue(self, marker: str | None = None) -> Any:
        _began(marker)
        return queue.Queue().get()

    @endpoint(call_limit_s=LIMIT_S)
    async def wait_on_event(self, marker: str | None = None) -> None:
        _began(marker)
        await anyio.Event().wait()

    @endpoint(call_limit_s=LIMIT_S)
    async def block_the_loop(self, marker: str | None = None) -> None:
        """An async endpoint that blocks its proc's event loop thread itself."""
        _began(marker)
        with self.lock:
            self.lock.acquire()

    @concurrent_endpoint(call_limit_s=LIMIT_S)
    def wait_concurrently(self, marker: str | None = None) -> None:
        _began(marker)
        threading.Event().wait()

    @endpoint(call_limit_s=10 * LIMIT_S)
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @endpoint
    def sleep_unlimited(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @endpoint(call_limit_s=2 * LIMIT_S)
    def pause(self, seconds: float) -> str:
        """Held as a debugger holds a rank: the watchdog suspended meanwhile."""
        with call_watchdog_suspended():
            time.sleep(seconds)
        return "resumed"

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def restart_count(self) -> int:
        return context().restart_count


class Unlimited(Stuck):
    """No limit for its endpoints without one of their own, whatever the setting says."""

    call_limit_s = math.inf


class StuckByClass(Stuck):
    """Every endpoint without a limit of its own gets the class's."""

    call_limit_s = LIMIT_S

    @endpoint(call_limit_s=math.inf)
    def sleep_exempt(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


class StuckCaller(Actor):
    """Calls an endpoint of a mesh it is handed (a caller that does not own it); says how the
    call ended: its value, or the kind and text of its `SupervisionError`."""

    @endpoint
    def call(self, target: Any, name: str, *args: Any) -> str:
        from supervision import SupervisionError

        try:
            return repr(getattr(target, name).call_one(*args).get(timeout=60))
        except SupervisionError as error:
            return f"FAILED {error.event.kind}: {error}"
        except TimeoutError:
            return "NO ANSWER"
