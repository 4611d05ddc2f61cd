"""Actors for the re-spawn and restart-policy tests (test_restarts.py).

They live in an importable module (``tests/`` is on ``sys.path`` and procs inherit the
client's ``sys.path``), so cloudpickle sends them by reference.

Destructive endpoints take an optional ``rank``: only the actor at that rank (in the mesh the
call was sent to) misbehaves; ``rank=None`` makes every recipient misbehave.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import anyio

from mesh import Actor, context, current_rank, endpoint
from mesh.testing import signal_this_process


class InitError(Exception):
    """What `Phoenix.__init__` raises when asked to."""


class BroadcastError(Exception):
    """What `Phoenix.fail` raises (in a broadcast, it fails the actor)."""


def _targeted(rank: int | None) -> bool:
    return rank is None or current_rank().rank == rank


class Phoenix(Actor):
    """Remembers how it was built and how often it was rebuilt; keeps per-instance state.

    `fail_first_init_on`: the constructor raises on that rank, but only on the first build
    (``restart_count == 0``), so a re-spawn brings it back.
    """

    def __init__(self, tag: str, *, scale: int = 1, fail_first_init_on: int | None = None) -> None:
        ctx = context()
        if (
            fail_first_init_on is not None
            and ctx.rank.rank == fail_first_init_on
            and ctx.restart_count == 0
        ):
            raise InitError(f"first construction refused on rank {ctx.rank.rank}")
        self.tag = tag
        self.scale = scale
        self.init_restart_count = ctx.restart_count
        self.init_rank = dict(ctx.rank)
        self.counter = 0
        self.built_at = time.time()

    @endpoint
    def info(self) -> dict[str, Any]:
        ctx = context()
        return {
            "pid": os.getpid(),
            "rank": ctx.rank.rank,
            "init_rank": self.init_rank,
            "restart_count": ctx.restart_count,
            "init_restart_count": self.init_restart_count,
            "tag": self.tag,
            "scale": self.scale,
            "counter": self.counter,
            "mesh": ctx.mesh_name,
        }

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.counter += by
        return self.counter

    @endpoint
    def get(self) -> int:
        return self.counter

    @endpoint
    async def park(self, seconds: float, rank: int | None = None) -> int:
        """Waits without blocking the proc: an in-flight call that only a failure ends."""
        if _targeted(rank):
            await anyio.sleep(seconds)
        return current_rank().rank

    @endpoint
    def fail(self, message: str = "boom", rank: int | None = None) -> int:
        """Raises on the targeted rank (as a broadcast, this fails the actor)."""
        if _targeted(rank):
            raise BroadcastError(message)
        return current_rank().rank

    @endpoint
    def exit(self, code: int, rank: int | None = None) -> int:
        if _targeted(rank):
            os._exit(code)
        return current_rank().rank

    @endpoint
    def kill_self(self, rank: int | None = None) -> int:
        if _targeted(rank):
            signal_this_process(signal.SIGKILL)
            time.sleep(30)
        return current_rank().rank
