"""Actors that stop in the debugger (tests/test_debugger.py): in their own module, so that
the procs that unpickle them import only this."""

from __future__ import annotations

from mesh import Actor, current_rank, endpoint
from mesh.testing import inbox_address


def doubled_plus_one(value: int) -> int:
    inner = value * 2
    return inner + 1


class Stepper(Actor):
    """Endpoints that stop in the debugger, sync and async."""

    @endpoint
    def step(self, x: int) -> int:
        a = x * 10
        breakpoint()
        b = a + current_rank().rank
        return b

    @endpoint
    async def step_async(self, x: int) -> int:
        a = x * 10
        breakpoint()
        c = doubled_plus_one(a)
        return c + current_rank().rank

    @endpoint
    def ping(self) -> int:
        return current_rank().rank


class Exposed(Actor):
    """Tells where its proc receives messages (it answers while a Stepper there is paused)."""

    @endpoint
    def address(self) -> str:
        return inbox_address()
