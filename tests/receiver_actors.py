"""Actors for tests/test_receiver.py (importable by procs)."""

from __future__ import annotations

import threading

from mesh import Actor, endpoint

#: Shared by the actors of one proc: `Gate.hold` waits for `Opener.open`.
_OPENED = threading.Event()


class Recorder(Actor):
    """Notes the order in which its calls ran, from sync and async endpoints alike."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    @endpoint
    def sync_note(self, i: int) -> int:
        self.seen.append(i)
        return i

    @endpoint
    async def async_note(self, i: int) -> int:
        self.seen.append(i)
        return i

    @endpoint
    def take(self) -> list[int]:
        seen, self.seen = self.seen, []
        return seen


class Gate(Actor):
    """A sync endpoint that blocks until another actor of its proc opens the gate."""

    @endpoint
    def hold(self, timeout: float) -> bool:
        return _OPENED.wait(timeout)


class Opener(Actor):
    @endpoint
    def open(self) -> str:
        _OPENED.set()
        return "opened"

    @endpoint
    def close(self) -> str:
        _OPENED.clear()
        return "closed"
