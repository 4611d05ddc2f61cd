"""The agent's heartbeat deadlines against its own serve loop: the loop's work never moves a
deadline (a hung proc is always reached), its oversleeping and pauses do (a paused agent kills
no healthy proc)."""

from __future__ import annotations

import os
import time

import pytest

from mesh.testing import ProcRecord, ProcTable, Watchdog, wire
from transport import get_logger

pytestmark = pytest.mark.timeout(30)

HEARTBEAT_S = 0.2
BUSY_S = 0.8


def watched_proc(busy_s: float = 10.0) -> tuple[Watchdog, ProcRecord]:
    table = ProcTable()
    spec = wire.ProcSpec("p0", "m", ("gpus",), (1,), 0)
    proc = ProcRecord(spec, "ipc://owner", "ipc://p0", HEARTBEAT_S, busy_s, pid=os.getpid())
    table.add(proc)
    dog = Watchdog(table, owner_timeout_s=10.0, log=get_logger("test.watchdog"))
    dog.heartbeat(proc)
    dog.start()
    return dog, proc


def serve_once(dog: Watchdog, work_s: float, overslept_s: float = 0.0) -> None:
    """One pass of a serve loop that no message wakes: work, wait for the next deadline, and
    oversleep it by `overslept_s` (starved, or paused)."""
    time.sleep(work_s)
    wait_s = dog.next_timeout()
    dog.waiting(wait_s)
    time.sleep(wait_s + overslept_s)
    dog.woke()


@pytest.mark.parametrize("work_s", [0.0, 0.001, 0.01, 0.05])
def test_the_loops_own_work_never_keeps_a_silent_proc_from_being_due(work_s: float) -> None:
    dog, proc = watched_proc()
    for _ in range(int(20 * HEARTBEAT_S / max(work_s, 0.001))):
        serve_once(dog, work_s)
        if list(dog.overdue(time.monotonic())):
            break
    assert [p for p, _ in dog.overdue(time.monotonic())] == [proc]


def test_an_overslept_wait_moves_the_deadlines_by_as_long() -> None:
    dog, proc = watched_proc()
    due = proc.heartbeat_due
    dog.waiting(0.0)
    time.sleep(0.1)
    dog.woke()
    assert proc.heartbeat_due - due >= 0.1
    assert proc.heartbeat_due - due < 0.1 + HEARTBEAT_S  # (not restarted: no pause)


@pytest.mark.parametrize("where", ["waiting", "working"])
def test_after_a_pause_every_deadline_restarts_from_now(where: str) -> None:
    dog, proc = watched_proc()
    if where == "waiting":
        serve_once(dog, 0.0, overslept_s=0.7)
    else:
        time.sleep(0.7)  # stopped between two waits
        dog.waiting(0.0)
    assert proc.heartbeat_due >= time.monotonic() + HEARTBEAT_S / 2
    assert not list(dog.overdue(time.monotonic()))


def test_an_agent_paused_again_and_again_still_reaches_a_silent_proc() -> None:
    """Pauses are forgiven up to the busy limit in all, not forever."""
    dog, proc = watched_proc(busy_s=BUSY_S)
    for _ in range(10):
        serve_once(dog, 0.0, overslept_s=0.6)
        if list(dog.overdue(time.monotonic())):
            break
    assert [p for p, _ in dog.overdue(time.monotonic())] == [proc]
    assert proc.forgiven_s == pytest.approx(BUSY_S)
