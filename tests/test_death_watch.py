"""A proc killed is seen by its robust mutex, before the kernel frees its memory (issue 16).

First the fork server's `DeathWatch` alone, on processes forked here: a kill is reported once,
with the status `waitpid` returns; an exit, an ``exec`` and a stop are not deaths it reports.
Then through a mesh: a kill of a proc with a big resident set reaches the owner as before.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from polling import pid_alive, wait_gone, wait_until
from recording import Recorder

from mesh import Actor, endpoint
from mesh.testing import DEATH_WAITER_NAME, SEES_DEATHS_EARLY, DeathWatch
from supervision import SupervisionError

T = 30.0
#: The death watch's own tests need futex_waitv; through a mesh, deaths are reported either way.
needs_futex_waitv = pytest.mark.skipif(
    not SEES_DEATHS_EARLY, reason="this kernel has no futex_waitv (Linux 5.16+)"
)


@pytest.fixture
def watch() -> Iterator[tuple[DeathWatch, list[int]]]:
    if not SEES_DEATHS_EARLY:
        pytest.skip("this kernel has no futex_waitv (Linux 5.16+)")
    """A death watch, and the pids forked under it (killed and reaped after the test)."""
    deaths, children = DeathWatch(), []
    yield deaths, children
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    deaths.close()


def _fork(deaths: DeathWatch, children: list[int], then: Callable[[], None]) -> int:
    """Fork a child that holds its mutex and runs `then`; once it holds it."""
    slot = deaths.arm()
    assert slot is not None, "futex_waitv is missing: this kernel cannot run these tests"
    held, holding = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            deaths.hold(slot)
            os.write(holding, b"x")
            then()
        finally:
            os._exit(0)
    deaths.watch(slot, pid)
    deaths.commit()
    children.append(pid)
    os.close(holding)
    os.read(held, 1)
    os.close(held)
    return pid


def _sleep() -> None:
    time.sleep(60)


def _touch(megabytes: int) -> Callable[[], None]:
    def run() -> None:
        memory = mmap.mmap(-1, megabytes << 20)
        for offset in range(0, len(memory), mmap.PAGESIZE):
            memory[offset] = 1
        time.sleep(60)

    return run


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as file:
        return file.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _deaths_until(deaths: DeathWatch, count: int) -> list[tuple[int, int]]:
    """The deaths the watch reports, until `count` of them (or its deadline)."""
    seen: list[tuple[int, int]] = []
    deadline = time.monotonic() + T
    while len(seen) < count and time.monotonic() < deadline:
        select.select([deaths], [], [], 0.1)
        seen += deaths.take()
    return seen


def _reap(deaths: DeathWatch, pid: int) -> tuple[int, bool]:
    """Reap `pid`: its status, and whether the watch says it is still to be reported."""
    _, status = os.waitpid(pid, 0)
    return status, deaths.reaped(pid, status)


def test_a_kill_is_reported_once_with_the_status_waitpid_returns(
    watch: tuple[DeathWatch, list[int]],
) -> None:
    deaths, children = watch
    pid = _fork(deaths, children, _touch(256))
    wait_until(lambda: _resident_mb(pid) >= 200, T, "the child to touch its memory")
    os.kill(pid, signal.SIGKILL)
    (seen,) = _deaths_until(deaths, 1)
    status, still_to_report = _reap(deaths, pid)
    assert seen == (pid, status) and os.WTERMSIG(status) == signal.SIGKILL
    assert not still_to_report


@pytest.mark.parametrize("code", [0, 3])
def test_an_exit_is_left_to_the_reap(watch: tuple[DeathWatch, list[int]], code: int) -> None:
    """A proc that exits by itself said what it had to say first: the reap reports it, after."""
    deaths, children = watch
    pid = _fork(deaths, children, lambda: os._exit(code))
    select.select([deaths], [], [], T)  # the watcher saw the mutex released
    assert deaths.take() == []
    status, still_to_report = _reap(deaths, pid)
    assert os.waitstatus_to_exitcode(status) == code and still_to_report


def test_an_exec_is_not_a_death(watch: tuple[DeathWatch, list[int]]) -> None:
    """``exec`` releases the mutex too, but the process lives on as another program."""
    deaths, children = watch
    script = "import time; time.sleep(60)"
    pid = _fork(deaths, children, lambda: os.execv(sys.executable, [sys.executable, "-c", script]))
    select.select([deaths], [], [], T)
    assert deaths.take() == [] and pid_alive(pid)
    os.kill(pid, signal.SIGKILL)
    status, still_to_report = _reap(deaths, pid)
    assert os.WTERMSIG(status) == signal.SIGKILL and still_to_report


def test_a_stopped_process_is_not_dead(watch: tuple[DeathWatch, list[int]]) -> None:
    """SIGSTOP releases nothing: when a canary killed after it is reported, the stopped
    process (watched by the same thread, looked at in the same pass) is not."""
    deaths, children = watch
    stopped = _fork(deaths, children, _sleep)
    canary = _fork(deaths, children, _sleep)
    os.kill(stopped, signal.SIGSTOP)
    wait_until(lambda: _stopped(stopped), T, "the process to stop")
    os.kill(canary, signal.SIGKILL)
    assert [pid for pid, _ in _deaths_until(deaths, 1)] == [canary]
    assert deaths.take() == [] and pid_alive(stopped)
    os.kill(stopped, signal.SIGCONT)
    assert _reap(deaths, canary)[1] is False


def test_many_deaths_at_once_across_watcher_threads(watch: tuple[DeathWatch, list[int]]) -> None:
    """More procs than one thread can wait on (127): each kill is reported once, and a slot
    freed by a reap serves again."""
    deaths, children = watch
    pids = [_fork(deaths, children, _sleep) for _ in range(140)]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    seen = dict(_deaths_until(deaths, len(pids)))
    assert sorted(seen) == sorted(pids)
    assert all(os.WTERMSIG(status) == signal.SIGKILL for status in seen.values())
    assert not any(_reap(deaths, pid)[1] for pid in pids)
    again = _fork(deaths, children, _sleep)
    os.kill(again, signal.SIGTERM)
    assert _deaths_until(deaths, 1)[0][0] == again


def test_without_its_waiter_every_exit_is_left_to_the_reap(
    watch: tuple[DeathWatch, list[int]],
) -> None:
    deaths, children = watch
    os.kill(deaths.waiter_pid, signal.SIGKILL)
    os.waitpid(deaths.waiter_pid, 0)
    select.select([deaths], [], [], T)
    assert deaths.take() == [] and not deaths.waiting
    pid = _fork(deaths, children, _sleep)
    os.kill(pid, signal.SIGKILL)
    status, still_to_report = _reap(deaths, pid)
    assert os.WTERMSIG(status) == signal.SIGKILL and still_to_report


@needs_futex_waitv
def test_the_waiter_dies_with_its_fork_server() -> None:
    """No process is left when the fork server is SIGKILLed (its agent killed): the waiter
    goes with it, and the mutexes' memory (an anonymous shared mapping) with the last proc."""
    ready_read, ready_write = os.pipe()
    server = os.fork()
    if server == 0:
        try:
            os.write(ready_write, str(DeathWatch().waiter_pid).encode())
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(ready_write)
    waiter = int(os.read(ready_read, 32))
    os.close(ready_read)
    assert pid_alive(waiter)
    os.kill(server, signal.SIGKILL)
    os.waitpid(server, 0)
    wait_gone([waiter])


def _resident_mb(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as file:
        return int(file.read().split()[1]) * mmap.PAGESIZE >> 20


# -- through a mesh -------------------------------------------------------------------------


class Resident(Actor):
    """Holds a big resident set, made cheaply: an anonymous mapping it touches page by page."""

    def __init__(self) -> None:
        self.memory: mmap.mmap | None = None

    @endpoint
    def hold(self, megabytes: int) -> int:
        self.memory = mmap.mmap(-1, megabytes << 20)
        for offset in range(0, len(self.memory), mmap.PAGESIZE):
            self.memory[offset] = 1
        return os.getpid()

    @endpoint
    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return "woke"

    @endpoint
    def exit_now(self, code: int) -> None:
        os._exit(code)


def _spawn(
    make_procs: Callable[..., Any], n: int, megabytes: int
) -> tuple[Any, Recorder, list[int]]:
    procs = make_procs({"gpus": n}, name="resident")
    recorder = Recorder()
    procs.on_failure(recorder)
    actors = procs.spawn("resident-actors", Resident)
    pids = list(actors.hold.call(megabytes).get(timeout=T).values())
    return actors, recorder, pids


def test_a_proc_killed_with_a_big_resident_set_is_reported_with_its_signal(
    make_procs: Callable[..., Any],
) -> None:
    actors, recorder, (pid,) = _spawn(make_procs, 1, 512)
    in_flight = actors.sleep.call_one(60.0)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(SupervisionError) as info:
        in_flight.get(timeout=T)
    (event,) = recorder.wait(1)
    for seen in (info.value.event, event):
        assert (seen.kind, seen.signal, seen.pid, seen.exit_code) == (
            "signal",
            "SIGKILL",
            pid,
            None,
        )


@pytest.mark.parametrize("code", [0, 3])
def test_a_proc_that_exits_is_reported_as_before(make_procs: Callable[..., Any], code: int) -> None:
    actors, recorder, (pid,) = _spawn(make_procs, 1, 1)
    actors.exit_now.broadcast(code)
    (event,) = recorder.wait(1)
    assert (event.kind, event.exit_code, event.signal, event.pid) == ("exit", code, None, pid)


def test_a_stopped_proc_is_not_reported(make_procs: Callable[..., Any]) -> None:
    """A proc stopped for a moment (well within its heartbeat timeout) and continued is well."""
    actors, recorder, pids = _spawn(make_procs, 2, 64)
    os.kill(pids[0], signal.SIGSTOP)
    wait_until(lambda: _stopped(pids[0]), T, "the proc to stop")
    os.kill(pids[1], signal.SIGKILL)  # a death seen meanwhile: the watch looked at both
    (event,) = recorder.wait(1)
    os.kill(pids[0], signal.SIGCONT)
    assert event.pid == pids[1]
    assert actors.slice(gpus=0).sleep.call_one(0.0).get(timeout=T) == "woke"
    assert len(recorder.events) == 1


def _name(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as file:
        return file.read().strip()


def _pipes(pid: int, skip_stdio: bool = False) -> set[str]:
    """The pipes process `pid` holds open."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if not (skip_stdio and int(fd) <= 2):
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return {link for link in links if link.startswith("pipe:")}


@needs_futex_waitv
def test_procs_hold_nothing_of_the_death_watch(make_procs: Callable[..., Any]) -> None:
    """A proc holds no descriptor of the death watch (its waiter's pipe to the fork server)."""
    _, _, pids = _spawn(make_procs, 2, 1)
    with open(f"/proc/{pids[0]}/stat") as file:
        server = int(file.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{server}/task/{server}/children") as file:
        others = {int(pid) for pid in file.read().split()} - set(pids)
    (waiter,) = [pid for pid in others if _name(pid) == DEATH_WAITER_NAME]
    notify = _pipes(waiter, skip_stdio=True)
    assert len(notify) == 1
    assert not any(notify & _pipes(pid) for pid in pids)


def test_many_procs_killed_at_once_are_each_reported(make_procs: Callable[..., Any]) -> None:
    _, recorder, pids = _spawn(make_procs, 6, 32)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    events = recorder.wait(len(pids))
    assert sorted(e.pid for e in events) == sorted(pids)
    assert {(e.kind, e.signal) for e in events} == {("signal", "SIGKILL")}
