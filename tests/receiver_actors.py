"""Actors for tests/test_receiver.py (importable by procs)."""

from __future__ import annotations

import threading
import time

from mesh import Actor, Port, current_rank, endpoint, testing

#: Shared by the actors of one proc: `Gate.hold` waits for `Opener.open`.
_OPENED = threading.Event()
#: `Ticker.wait_for_nap` waits for `Spinner.nap_while_ticking` to start.
_NAPPING = threading.Event()
#: How many `Ticker.tick` calls ended.
_TICKS = [0]


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

    @endpoint
    def hold_telling(self, started: Port[str], timeout: float) -> bool:
        """`hold`, saying on `started` that it runs."""
        started.send("holding")
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


class Spinner(Actor):
    """A sync endpoint that keeps its thread busy (never blocking) until the gate opens."""

    @endpoint
    def spin(self, started: Port[str], timeout: float) -> bool:
        started.send("spinning")
        deadline = time.monotonic() + timeout
        while not _OPENED.is_set() and time.monotonic() < deadline:
            pass
        return _OPENED.is_set()

    @endpoint
    def nap(self, started: Port[str], timeout: float) -> bool:
        """Naps of 1 ms until the gate opens: asleep most of the time, never for long."""
        started.send("napping")
        deadline = time.monotonic() + timeout
        while not _OPENED.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)
        return _OPENED.is_set()

    @endpoint
    def nap_while_ticking(self, started: Port[str], timeout: float) -> int:
        """`nap`, letting the ticker's queued ticks go first; how many ticks ended by the
        time the gate opened."""
        ticks_before = _TICKS[0]
        _NAPPING.set()
        started.send("napping")
        deadline = time.monotonic() + timeout
        while not _OPENED.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)
        return _TICKS[0] - ticks_before


class Ticker(Actor):
    """Calls that end steadily on a worker thread of their own while another call naps."""

    @endpoint
    def wait_for_nap(self, timeout: float) -> bool:
        napping = _NAPPING.wait(timeout)
        _NAPPING.clear()
        return napping

    @endpoint
    def tick(self) -> None:
        """2 ms asleep until the gate opens; at once after."""
        if not _OPENED.is_set():
            time.sleep(0.002)
        _TICKS[0] += 1


class Echo(Actor):
    """A short sync call, and how many times its proc's receiver handed the inbox over."""

    @endpoint
    def ping(self, x: int) -> int:
        return x

    @endpoint
    def busy(self, x: int, seconds: float) -> int:
        """Answers `x` after keeping its thread busy for `seconds` of CPU time."""
        until = time.thread_time() + seconds
        while time.thread_time() < until:
            pass
        return x

    @endpoint
    def hand_overs(self) -> int:
        return testing.receiver_hand_overs()

    @endpoint
    def idle_alarms(self) -> int:
        return testing.receiver_idle_alarms()


class Notes(Actor):
    """Notes the order of its calls; lone calls (`mesh/_engine/lone_calls.py`) counted."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    @endpoint
    def note(self, i: int) -> int:
        self.seen.append(i)
        return i

    @endpoint
    def slow_note(self, i: int, seconds: float) -> int:
        time.sleep(seconds)
        self.seen.append(i)
        return i

    @endpoint
    async def async_note(self, i: int) -> int:
        self.seen.append(i)
        return i

    @endpoint
    def fail(self, text: str) -> None:
        raise ValueError(text)

    @endpoint
    def make_lock(self) -> threading.Lock:
        """A result that cannot be pickled."""
        return threading.Lock()

    @endpoint
    def where(self) -> dict[str, int]:
        return dict(current_rank())

    @endpoint
    def take(self) -> list[int]:
        seen, self.seen = self.seen, []
        return seen

    @endpoint
    def lone_calls(self) -> int:
        return testing.receiver_lone_calls()
