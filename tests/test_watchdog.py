"""The agent's heartbeat deadlines against its own serve loop: the loop's work never moves a
deadline (a hung proc is always reached), its oversleeping and pauses do (a paused agent kills
no healthy proc)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from polling import wait_until

from mesh.testing import OwnWaits, ProcRecord, ProcTable, Watchdog, wire
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


# -- a silent proc that died is not hung: its exit report, with its signal, is on the way -------


def _silent_child() -> subprocess.Popen[bytes]:
    """A child process whose heartbeats the watchdog expects: never sent."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _judged_after_silence(child: subprocess.Popen[bytes]) -> tuple[str | None, ProcRecord]:
    dog, proc = watched_proc()
    proc.pid = child.pid
    dog.heartbeat(proc)  # the baseline sample, while it lives
    now = proc.heartbeat_due + 0.1
    return dog.judge_silence(proc, child.pid, now), proc


@pytest.mark.parametrize("reaped", [False, True], ids=["zombie", "reaped"])
def test_a_dead_proc_is_not_judged_hung_before_its_exit_is_reported(reaped: bool) -> None:
    """Killed and not yet reaped (a zombie), or reaped by the fork server whose report the
    agent has not read yet: either way it is dead, to be reported as such, not hung."""
    child = _silent_child()
    child.send_signal(signal.SIGKILL)
    if reaped:
        child.wait(10)
    else:  # a zombie: waitid without reaping it
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    try:
        why, proc = _judged_after_silence(child)
        assert why is None, why
        assert proc.heartbeat_due > time.monotonic()  # asked again later, if still in the table
    finally:
        child.wait(10)


def test_a_stopped_proc_is_still_judged_hung() -> None:
    """The other side of the rule: a live proc that cannot run is hung, and says why."""
    child = _silent_child()
    try:
        child.send_signal(signal.SIGSTOP)
        os.waitid(os.P_PID, child.pid, os.WSTOPPED | os.WNOWAIT)
        why, _ = _judged_after_silence(child)
        assert why is not None and "stopped" in why, why
    finally:
        child.kill()
        child.wait(10)


# -- a silent proc on a starved host: the agent's own waiting for a core gives it time ----------


@pytest.fixture
def idle_child() -> Iterator[subprocess.Popen[str]]:
    """A child process that has started and sleeps: it uses no CPU time from now on."""
    code = "import time; print('ready', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    try:
        assert child.stdout.readline() == "ready\n"
        wait_until(lambda: _state(child.pid) == "S", 10, "the child to sleep")  # not runnable
        yield child
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()


def _state(pid: int) -> str:
    """The scheduler state of `pid` (R running or runnable, S sleeping...)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def _starving(
    child: subprocess.Popen[str], heartbeat_s: float = HEARTBEAT_S
) -> tuple[Watchdog, ProcRecord, list[float]]:
    """A watchdog whose agent's waiting for a core is the list's value (the test sets it),
    over a proc that is `child` and just sent a heartbeat."""
    waited = [0.0]
    table = ProcTable()
    spec = wire.ProcSpec("p0", "m", ("gpus",), (1,), 0)
    proc = ProcRecord(spec, "ipc://owner", "ipc://p0", heartbeat_s, 10.0, pid=child.pid)
    table.add(proc)
    own = OwnWaits(read=lambda: waited[0], every_s=0.0)
    dog = Watchdog(table, owner_timeout_s=10.0, log=get_logger("test.watchdog"), own=own)
    dog.waiting(0.0)  # the serve loop samples the agent's waiting as it goes round
    dog.heartbeat(proc)
    return dog, proc, waited


@pytest.mark.parametrize("starved_s", [0.0, 0.01, 0.1])
def test_a_silent_idle_proc_gets_as_long_as_its_agent_waited_for_a_core(
    idle_child: subprocess.Popen[str], starved_s: float
) -> None:
    """Its heartbeats may wait unread in the agent's starved zmq thread: the time the agent
    waited for a core while the proc was silent is added to its deadline, once (noise, under
    50 ms, is not); with no more waiting, it is hung at the next look."""
    dog, proc, waited = _starving(idle_child)
    waited[0] = starved_s
    now = proc.heartbeat_due + 0.01
    why = dog.judge_silence(proc, idle_child.pid, now)
    if starved_s >= 0.05:
        assert why is None and proc.heartbeat_due == pytest.approx(now + starved_s)
        why = dog.judge_silence(proc, idle_child.pid, proc.heartbeat_due)
    assert why is not None and "used no CPU time" in why, why


def test_a_starved_agent_looks_at_a_silent_proc_at_most_every_eighth_timeout(
    idle_child: subprocess.Popen[str],
) -> None:
    """Each look reads /proc: waiting a little over the noise gives an eighth of a heartbeat
    timeout, not 50 ms, so a loaded agent does not look at its late procs at every pass; with
    no more waiting, the proc is still hung at the next look."""
    dog, proc, waited = _starving(idle_child, heartbeat_s=2.0)
    waited[0] = 0.06
    now = proc.heartbeat_due + 0.01
    assert dog.judge_silence(proc, idle_child.pid, now) is None
    assert proc.heartbeat_due == pytest.approx(now + 2.0 / 8)
    why = dog.judge_silence(proc, idle_child.pid, proc.heartbeat_due)
    assert why is not None and "used no CPU time" in why, why


def test_the_time_given_for_a_starved_agent_is_bounded(idle_child: subprocess.Popen[str]) -> None:
    """However long the agent waits, a silent proc is hung within three heartbeat timeouts."""
    dog, proc, waited = _starving(idle_child)
    looks, why = 0, None
    while why is None:
        waited[0] += 10.0  # starved all along
        now = proc.heartbeat_due
        why = dog.judge_silence(proc, idle_child.pid, now)
        looks += 1
        assert looks < 10
    assert now - proc.silent_since <= 3 * HEARTBEAT_S + 1e-6 and "no CPU" in why


def test_a_stopped_proc_gets_no_time_for_a_starved_agent(
    idle_child: subprocess.Popen[str],
) -> None:
    dog, proc, waited = _starving(idle_child)
    idle_child.send_signal(signal.SIGSTOP)
    os.waitid(os.P_PID, idle_child.pid, os.WSTOPPED | os.WNOWAIT)
    waited[0] = 1.0
    why = dog.judge_silence(proc, idle_child.pid, proc.heartbeat_due)
    assert why is not None and "stopped" in why, why


def test_the_agents_waiting_for_a_core_is_read_and_never_goes_back() -> None:
    own = OwnWaits()
    first = own.now(time.monotonic())
    sum(range(200_000))  # some work, maybe preempted
    again = own.now(time.monotonic())
    assert first is not None and again is not None and 0 <= first <= again
    assert own.at(time.monotonic()) == again and own.at(0.0) == first
