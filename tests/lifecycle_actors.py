"""Actors for the tests of concurrent endpoints and of the actor lifecycle.

Importable (procs get them by reference), so module globals are per proc: a `Meeting` lets
calls of one actor wait for each other, and a `Tally` actor in the same proc can watch them.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio

from mesh import Actor, concurrent_endpoint, context, current_rank, endpoint

#: Longest time a test actor waits for another call before giving up (a bound, not a timing).
WAIT_S = 60.0

# -- per-proc meeting points, for calls that must overlap --------------------------------------

_lock = threading.Condition()
_state: dict[str, int] = {"active": 0, "peak": 0, "released": 0}
_barriers: dict[tuple[str, int], threading.Barrier] = {}
_arrived: dict[str, anyio.Event] = {}


def _barrier(name: str, parties: int) -> threading.Barrier:
    with _lock:
        return _barriers.setdefault((name, parties), threading.Barrier(parties, timeout=WAIT_S))


def _event(name: str) -> anyio.Event:
    return _arrived.setdefault(name, anyio.Event())


class Overlapping(Actor):
    """Concurrent endpoints that finish only when others run at the same time."""

    def __init__(self) -> None:
        self.order: list[int] = []

    @concurrent_endpoint
    def meet(self, name: str, parties: int) -> int:
        """Sync: waits until `parties` calls have reached it (BrokenBarrierError if not)."""
        return _barrier(name, parties).wait()

    @concurrent_endpoint
    async def ameet(self, mine: str, other: str) -> str:
        """Async: signals `mine`, then waits for the call that signals `other`."""
        _event(mine).set()
        with anyio.fail_after(WAIT_S):
            await _event(other).wait()
        return mine

    @concurrent_endpoint
    async def aknock(self, name: str) -> str:
        _event(name).set()
        return name

    @concurrent_endpoint
    async def ajoin(self, name: str) -> str:
        with anyio.fail_after(WAIT_S):
            await _event(name).wait()
        return name

    @endpoint
    def append(self, value: int) -> int:
        self.order.append(value)
        return value

    @concurrent_endpoint
    async def aconcurrent_echo(self, value: int) -> int:
        return value

    @concurrent_endpoint
    def concurrent_echo(self, value: int) -> int:
        return value

    @endpoint
    def appended(self) -> list[int]:
        return self.order

    @concurrent_endpoint
    def raise_value_error(self, message: str) -> None:
        raise ValueError(message)

    @concurrent_endpoint
    async def araise_base(self) -> None:
        raise KeyboardInterrupt("a fatal error in a concurrent endpoint")

    @concurrent_endpoint
    def where(self) -> int:
        return current_rank().rank


class Bounded(Actor):
    """At most two of its concurrent calls run at once; each waits until released."""

    max_concurrent_calls = 2

    @concurrent_endpoint
    def hold(self, value: int) -> int:
        with _lock:
            _state["active"] += 1
            _state["peak"] = max(_state["peak"], _state["active"])
            _lock.notify_all()
            _lock.wait_for(lambda: _state["released"] > 0, timeout=WAIT_S)
            _state["active"] -= 1
        return value

    @endpoint
    def peak(self) -> int:
        return _state["peak"]


class Tally(Actor):
    """Watches `Bounded` from outside its mailbox (same proc)."""

    @endpoint
    def wait_active(self, count: int) -> int:
        with _lock:
            _lock.wait_for(lambda: _state["active"] >= count, timeout=WAIT_S)
            return _state["active"]

    @endpoint
    def release(self) -> None:
        with _lock:
            _state["released"] = 1
            _lock.notify_all()


# -- lifecycle -------------------------------------------------------------------------------


def _record(path: str, line: str) -> None:
    with open(path, "a") as file:
        file.write(line + "\n")


class CleansUp(Actor):
    """Writes what its ``__cleanup__`` was given to `path`, one line per call."""

    def __init__(self, path: str, fail_in_cleanup: bool = False) -> None:
        self.path = path
        self.fail_in_cleanup = fail_in_cleanup

    def __cleanup__(self, exc: BaseException | None) -> None:
        _record(self.path, f"{context().rank.rank} {type(exc).__name__} {exc}")
        if self.fail_in_cleanup:
            raise RuntimeError("cleanup exploded")

    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def raise_base(self) -> None:
        raise SystemExit("fatal in endpoint")

    @endpoint
    def abort(self, reason: str | None) -> None:
        context().actor_instance.abort(reason)

    @endpoint
    def raise_value_error(self) -> None:
        raise ValueError("only the call fails")


class AsyncCleansUp(Actor):
    """An async ``__cleanup__`` (it runs on the proc's event loop)."""

    def __init__(self, path: str) -> None:
        self.path = path

    async def __cleanup__(self, exc: BaseException | None) -> None:
        await anyio.lowlevel.checkpoint()
        _record(self.path, f"async {type(exc).__name__}")

    @endpoint
    async def ping(self) -> str:
        return "pong"


class SlowToBuild(Actor):
    """A constructor that fails on `fail_on_rank`, or waits for a gate on `wait_on_rank`."""

    def __init__(self, fail_on_rank: int | None = None) -> None:
        if current_rank().rank == fail_on_rank:
            raise ValueError(f"rank {fail_on_rank} cannot be built")

    @endpoint
    def ping(self) -> str:
        return "pong"


class AbortsInConstructor(Actor):
    def __init__(self, reason: str) -> None:
        context().actor_instance.abort(reason)


class CatchesEverything(Actor):
    """Aborts inside ``try/except Exception``: the abort still goes through."""

    @endpoint
    async def abort(self, reason: str) -> Any:
        try:
            context().actor_instance.abort(reason)
        except Exception as exc:
            return f"swallowed {exc!r}"
        return "returned"
