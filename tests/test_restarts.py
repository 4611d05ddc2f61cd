"""Re-spawning failed ranks: by hand (`ProcMesh.respawn`) and by `RestartPolicy`.

Real procs, real failures: SIGKILL from outside (pids come from the actors themselves),
``os._exit`` inside an endpoint, a SIGSTOP-ed proc killed by its agent, a constructor or a
broadcast that raises.

This pytest process is a meshvisor client whose fail-fast would interrupt pytest's main thread,
so every proc mesh gets a recording ``on_failure`` handler and an autouse guard installs a
global unhandled-failure hook that records (and so swallows) anything else; the guard fails
the test if something reached it.

Nothing here sleeps to let things happen: tests poll for a condition with a deadline (a call
that succeeds on a new pid, a handler that got its event). Timings are only asserted as lower
bounds or ratios (backoff).

Every proc mesh comes from the `meshes` fixture, which stops it after the test and then checks
that no proc process of ours is left (and kills any that is, so the session stays clean).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import failing_actors as fa
import pytest
import restart_actors as ra
from conftest import AGENT_COMMANDS
from polling import wait_gone, wait_until
from recording import Recorder

import mesh.testing
from mesh import ActorMesh, ProcMesh, this_host, this_proc
from mesh.testing import DEATH_WAITER_NAME
from supervision import ActorError, RestartPolicy, SupervisionError, SupervisionEvent

pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("no_failure_reaches_the_root")]

T = 20.0  # the bound on every wait (never reached when things work)
STOP_TIMEOUT_S = 10.0
#: A policy that restarts at once and never runs out of restarts in a test.
EAGER: dict[str, Any] = {"jitter": 0.0, "max_restarts": 10, "within_s": 60.0}


# -- helpers ------------------------------------------------------------------------------------


def retry(
    attempt: Callable[[], Any], until: Callable[[Any], bool] = lambda _: True, timeout: float = T
) -> tuple[Any, int]:
    """Call `attempt()` until it returns a value satisfying `until`; a `SupervisionError`
    (a call that reached the dead proc before its failure was known) means: try again.
    Returns the value and how many attempts raised."""
    deadline = time.monotonic() + timeout
    failures = 0
    while True:
        try:
            value = attempt()
        except SupervisionError:
            failures += 1
        else:
            if until(value):
                return value, failures
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no satisfying answer within {timeout} s "
                f"({failures} attempts raised SupervisionError)"
            )
        time.sleep(0.005)


def pid_of(actors: ActorMesh[Any], rank: int) -> int:
    return int(actors.slice(gpus=rank).pid.call_one().get(timeout=T))


def pids_of(actors: ActorMesh[Any]) -> list[int]:
    return list(actors.pid.call().get(timeout=T).values())


def infos(actors: ActorMesh[Any]) -> list[dict[str, Any]]:
    return list(actors.info.call().get(timeout=T).values())


def new_pid(actors: ActorMesh[Any], rank: int, old: int, timeout: float = T) -> int:
    """Wait until rank `rank` answers again, from a process other than `old`."""
    pid, _ = retry(lambda: pid_of(actors, rank), lambda p: p != old, timeout)
    return int(pid)


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _our_run_base() -> str:
    return os.environ["XDG_RUNTIME_DIR"]  # conftest points it at this session's directory


def proc_processes() -> set[int]:
    """Live proc processes of this test session (not the agents, not their fork servers).

    Agents are children of this process and fork servers children of an agent; procs are
    the children of a fork server other than its death waiter."""
    table: dict[int, int] = {}
    marker = _our_run_base()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        is_agent = any(command in cmdline for command in AGENT_COMMANDS)
        if is_agent and marker in cmdline and stat[0] != "Z" and name != DEATH_WAITER_NAME:
            table[int(entry.name)] = int(stat[1])
    agents = {pid for pid, ppid in table.items() if ppid == os.getpid()}
    servers = {pid for pid, ppid in table.items() if ppid in agents}
    return {pid for pid in table if pid not in agents and pid not in servers}


class Meshes:
    """Makes proc meshes, each with a recording ``on_failure`` handler."""

    def __init__(self) -> None:
        self.made: list[ProcMesh] = []
        self.baseline: set[int] | None = None
        self.checked_elsewhere: set[int] = set()  # leftovers another test is about

    def __call__(
        self,
        n: int | dict[str, int] = 2,
        name: str = "workers",
        restart: RestartPolicy | None = None,
        **kwargs: Any,
    ) -> tuple[ProcMesh, Recorder]:
        host = this_host()  # starts the local agent on first use, before the baseline
        if self.baseline is None:
            self.baseline = proc_processes()
        per_host = {"gpus": n} if isinstance(n, int) else n
        procs = host.spawn_procs(per_host=per_host, name=name, restart=restart, **kwargs)
        recorder = Recorder()
        procs.on_failure(recorder)
        self.made.append(procs)
        return procs, recorder

    def forget(self, procs: ProcMesh) -> None:
        """The test stops `procs` itself (the teardown only looks for leftovers)."""
        self.made.remove(procs)

    def strays(self) -> set[int]:
        return proc_processes() - (self.baseline or set())


@pytest.fixture
def meshes(root_events: list[SupervisionEvent], request: pytest.FixtureRequest) -> Iterator[Meshes]:
    """Factory of proc meshes. After the test: stop them all, then no proc process made
    during the test may be left. Leftovers are killed either way; they fail the teardown only
    if the test itself passed (a failed test already reports what went wrong)."""
    failed_before = request.session.testsfailed
    factory = Meshes()
    yield factory
    errors = []
    for procs in reversed(factory.made):
        try:
            procs.stop().get(timeout=STOP_TIMEOUT_S)
        except Exception as exc:
            errors.append(f"{procs!r} did not stop: {exc!r}")
    left: set[int] = set()
    if factory.baseline is not None:
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not factory.strays(), 1.0)
        left = factory.strays()
        for pid in left:
            with contextlib.suppress(OSError):
                kill(pid)
        wait_gone(sorted(left))
    if left - factory.checked_elsewhere:
        errors.append(f"proc processes left behind (killed now): {sorted(left)}")
    if errors and request.session.testsfailed == failed_before:
        pytest.fail("; ".join(errors))


# -- ProcMesh.respawn(): by hand ------------------------------------------------------------------


def test_respawn_rebuilds_a_killed_rank_and_every_actor_mesh_on_it(meshes: Meshes) -> None:
    procs, recorder = meshes(3)
    alpha = procs.spawn("alpha", ra.Phoenix, "a-tag", scale=7)
    beta = procs.spawn("beta", ra.Phoenix, "b-tag")
    # An actor mesh on a slice of the procs: rank 1 of it lives on proc rank 2.
    gamma = procs.slice(gpus=slice(1, 3)).spawn("gamma", ra.Phoenix, "c-tag")
    rank2 = alpha.slice(gpus=2)  # a handle made before the failure
    alpha.incr.call(5).get(timeout=T)
    beta.incr.call(6).get(timeout=T)
    gamma.incr.call(7).get(timeout=T)
    before = pids_of(alpha)

    kill(before[2])
    (event,) = recorder.wait(1)
    assert (event.kind, event.signal, event.pid) == ("signal", "SIGKILL", before[2])
    with pytest.raises(SupervisionError):
        rank2.info.call_one().get(timeout=T)

    respawned = procs.respawn()
    # Calls made before the new proc is up wait for it (same handles as before the failure).
    early = rank2.info.call_one()
    assert respawned.get(timeout=T) is None
    assert early.get(timeout=T)["restart_count"] == 1

    after = infos(alpha)
    assert [i["pid"] for i in after[:2]] == before[:2]  # healthy ranks: same process...
    assert [i["counter"] for i in after[:2]] == [5, 5]  # ...and same state
    assert [i["restart_count"] for i in after] == [0, 0, 1]
    new = after[2]
    assert new["pid"] != before[2]
    wait_gone([before[2]], T)  # a kill is reported before the reap
    assert (new["tag"], new["scale"], new["counter"]) == ("a-tag", 7, 0)  # same arguments
    assert new["init_rank"] == {"gpus": 2} and new["init_restart_count"] == 1
    assert new["mesh"] == "alpha"
    assert [(i["pid"], i["counter"], i["restart_count"]) for i in infos(beta)] == [
        (before[0], 6, 0),
        (before[1], 6, 0),
        (new["pid"], 0, 1),
    ]
    assert [
        (i["pid"], i["init_rank"], i["counter"], i["restart_count"], i["tag"]) for i in infos(gamma)
    ] == [(before[1], {"gpus": 0}, 7, 0, "c-tag"), (new["pid"], {"gpus": 1}, 0, 1, "c-tag")]
    assert len(recorder.events) == 1

    # The re-spawned proc is the same rank of the same mesh: its death is reported as such,
    # and a second respawn counts again.
    kill(new["pid"])
    second = recorder.wait(2)[1]
    assert (second.kind, second.mesh_name, dict(second.rank or {}), second.pid) == (
        "signal",
        "workers",
        {"gpus": 2},
        new["pid"],
    )
    procs.respawn().get(timeout=T)
    again = infos(alpha)
    assert [i["restart_count"] for i in again] == [0, 0, 2]
    assert [i["pid"] for i in again[:2]] == before[:2]
    assert again[2]["pid"] not in (before[2], new["pid"])
    assert len(recorder.events) == 2


def test_respawn_brings_back_a_proc_that_exited(meshes: Meshes) -> None:
    procs, recorder = meshes(2)
    actors = procs.spawn("actors", ra.Phoenix, "t")
    before = pids_of(actors)
    with pytest.raises(SupervisionError):
        actors.exit.call(3, rank=0).get(timeout=T)
    (event,) = recorder.wait(1)
    assert (event.kind, event.exit_code) == ("exit", 3)
    procs.respawn().get(timeout=T)
    after = infos(actors)
    assert after[0]["pid"] != before[0] and after[0]["restart_count"] == 1
    assert (after[1]["pid"], after[1]["restart_count"]) == (before[1], 0)


def test_respawn_rebuilds_an_actor_whose_constructor_raised(meshes: Meshes) -> None:
    procs, recorder = meshes(3)
    probe = procs.spawn("probe", ra.Phoenix, "probe")
    actors = procs.spawn("actors", ra.Phoenix, "t", fail_first_init_on=1)
    pids = pids_of(probe)
    with pytest.raises(SupervisionError):
        actors.info.call().get(timeout=T)
    (event,) = recorder.wait(1)
    assert event.kind == "exception" and "constructor" in event.message
    assert "InitError" in event.message and dict(event.rank or {}) == {"gpus": 1}

    procs.respawn().get(timeout=T)
    after, _ = retry(lambda: infos(actors))
    assert [i["pid"] for i in after] == pids  # the procs were never replaced
    assert [i["restart_count"] for i in after] == [0, 1, 0]
    assert [i["restart_count"] for i in infos(probe)] == [0, 0, 0]
    assert len(recorder.events) == 1


def test_respawn_rebuilds_an_actor_failed_by_a_broadcast_each_time(meshes: Meshes) -> None:
    procs, recorder = meshes(2)
    actors = procs.spawn("actors", ra.Phoenix, "t")
    other = procs.spawn("other", ra.Phoenix, "o")
    actors.incr.call(2).get(timeout=T)
    other.incr.call(3).get(timeout=T)
    pids = pids_of(actors)
    for round_ in (1, 2):
        actors.fail.broadcast("no one listens", rank=0)
        events = recorder.wait(round_)  # reported again after a rebuild
        assert events[-1].kind == "exception" and "BroadcastError" in events[-1].message
        with pytest.raises(SupervisionError):
            actors.slice(gpus=0).info.call_one().get(timeout=T)
        procs.respawn().get(timeout=T)
        after, _ = retry(lambda: infos(actors))
        assert [i["pid"] for i in after] == pids
        assert [(i["restart_count"], i["counter"]) for i in after] == [(round_, 0), (0, 2)]
    # The other actor mesh on the same procs was never touched.
    assert [(i["restart_count"], i["counter"]) for i in infos(other)] == [(0, 3), (0, 3)]
    assert len(recorder.events) == 2


def test_respawn_with_nothing_failed_changes_nothing(meshes: Meshes) -> None:
    procs, recorder = meshes(2)
    actors = procs.spawn("actors", ra.Phoenix, "t")
    actors.incr.call(4).get(timeout=T)
    before = infos(actors)
    assert procs.respawn().get(timeout=T) is None
    assert procs.slice(gpus=1).respawn().get(timeout=T) is None
    assert infos(actors) == before
    assert recorder.events == []


def test_respawn_of_a_slice_respawns_only_its_failed_procs(meshes: Meshes) -> None:
    procs, recorder = meshes(3)
    actors = procs.spawn("actors", ra.Phoenix, "t")
    before = pids_of(actors)
    kill(before[0])
    kill(before[2])
    recorder.wait(2)
    procs.slice(gpus=1).respawn().get(timeout=T)  # nothing failed there
    procs.slice(gpus=0).respawn().get(timeout=T)
    rank0 = actors.slice(gpus=0).info.call_one().get(timeout=T)
    assert rank0["pid"] != before[0] and rank0["restart_count"] == 1
    with pytest.raises(SupervisionError):
        actors.slice(gpus=2).info.call_one().get(timeout=T)
    procs.slice(gpus=slice(1, 3)).respawn().get(timeout=T)
    after = infos(actors)
    assert [i["restart_count"] for i in after] == [1, 0, 1]
    assert after[1]["pid"] == before[1]
    assert len(recorder.events) == 2


def test_respawn_of_a_slice_leaves_failed_actors_outside_it(meshes: Meshes) -> None:
    """Like failed procs, failed actors outside the slice stay failed."""
    procs, recorder = meshes(2)
    actors = procs.spawn("actors", ra.Phoenix, "t")
    actors.info.call().get(timeout=T)
    actors.fail.broadcast("x", rank=1)
    recorder.wait(1)
    procs.slice(gpus=0).respawn().get(timeout=T)
    with pytest.raises(SupervisionError):
        info = actors.slice(gpus=1).info.call_one().get(timeout=T)
        raise AssertionError(f"rank 1 was rebuilt by a respawn of rank 0 only: {info}")


def test_actor_mesh_handler_still_hears_of_its_proc_after_a_respawn(meshes: Meshes) -> None:
    procs, proc_recorder = meshes(2)
    actors = procs.spawn("actors", ra.Phoenix, "t")
    actor_recorder = Recorder()
    actors.on_failure(actor_recorder)
    kill(pid_of(actors, 1))
    actor_recorder.wait(1)
    procs.respawn().get(timeout=T)
    kill(pid_of(actors, 1))
    wait_until(
        lambda: len(actor_recorder.events) + len(proc_recorder.events) >= 2,
        what="the second death to be reported",
    )
    assert len(actor_recorder.events) == 2, (
        f"the actor mesh's handler missed the second death; the proc mesh's got "
        f"{proc_recorder.events}"
    )


def test_respawn_of_a_mesh_not_spawned_here_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot re-spawn"):
        this_proc().respawn()


# -- RestartPolicy: automatic restarts -------------------------------------------------------------


def test_policy_restarts_a_killed_rank_without_telling_anyone(meshes: Meshes) -> None:
    procs, recorder = meshes(3, restart=RestartPolicy(**EAGER))
    actors = procs.spawn("actors", ra.Phoenix, "t", scale=3)
    actor_recorder = Recorder()
    actors.on_failure(actor_recorder)
    actors.incr.call(1).get(timeout=T)
    before = pids_of(actors)
    in_flight = actors.park.call(T, rank=1)
    kill(before[1])
    with pytest.raises(SupervisionError) as info:  # at most once: it is not re-sent
        in_flight.get(timeout=T)
    assert info.value.event.pid == before[1]
    replaced = new_pid(actors, 1, before[1])
    after = infos(actors)
    assert [i["pid"] for i in after] == [before[0], replaced, before[2]]
    assert [(i["restart_count"], i["counter"]) for i in after] == [(0, 1), (1, 0), (0, 1)]
    assert (after[1]["tag"], after[1]["scale"], after[1]["init_rank"]) == ("t", 3, {"gpus": 1})
    wait_gone([before[1]], T)  # a kill is reported before the reap
    assert recorder.events == [] and actor_recorder.events == []


def test_calls_made_while_a_rank_restarts_wait_for_it(meshes: Meshes) -> None:
    backoff = 0.5
    procs, recorder = meshes(2, restart=RestartPolicy(backoff_s=backoff, **EAGER))
    actors = procs.spawn("actors", ra.Phoenix, "t")
    before = pids_of(actors)
    in_flight = actors.park.call(T, rank=1)
    kill(before[1])
    with pytest.raises(SupervisionError):
        in_flight.get(timeout=T)
    # The failure is known now: from here on, calls to the restarting rank wait (through the
    # backoff) instead of failing. (A call made in the instant right after the failure was
    # reported may still fail: test_a_call_right_after_a_failure_report_waits is about that.)
    start = time.monotonic()

    def calls() -> list[Any]:
        waiting = [actors.slice(gpus=1).info.call_one(), actors.info.call(), actors.get.call()]
        return [f.get(timeout=T) for f in waiting]

    results, _ = retry(calls)
    waited = time.monotonic() - start
    assert results[0]["pid"] != before[1] and results[0]["restart_count"] == 1
    assert [i["pid"] for i in results[1].values()] == [before[0], results[0]["pid"]]
    assert results[2].values() == (0, 0)
    assert waited >= backoff * 0.8, f"the calls did not wait for the restart ({waited:.3f} s)"
    assert recorder.events == []


def test_calls_wait_for_a_restart_only_so_long(meshes: Meshes) -> None:
    """A restart that does not come back in time fails the calls waiting for it (and is
    reported), instead of leaving them waiting without end."""
    policy = RestartPolicy(backoff_s=5.0, jitter=0.0, max_restarts=1, within_s=60.0)
    procs, recorder = meshes(2, restart=policy)
    actors = procs.spawn("actors", ra.Phoenix, "t")
    before = pids_of(actors)
    with mesh.testing.settings(restart_wait_s=0.3):
        in_flight = actors.park.call(T, rank=1)
        kill(before[1])
        with pytest.raises(SupervisionError):
            in_flight.get(timeout=T)
        start = time.monotonic()
        with pytest.raises(SupervisionError, match=r"did not complete within 0\.3 s"):
            actors.slice(gpus=1).info.call_one().get(timeout=T)
        assert time.monotonic() - start < 4.0, "the call waited for the whole backoff"
        deadline = time.monotonic() + T
        while not recorder.events and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [event.kind for event in recorder.events] == ["spawn_failed"]


def test_a_call_right_after_a_failure_report_waits(meshes: Meshes) -> None:
    """The in-flight call that fails is how the caller learns of the failure; a call it makes
    right then must already wait for the restart (not fail on the dead proc). A race, so it
    is tried many times, with frequent thread switches to give the caller its chance."""
    procs, recorder = meshes(2, restart=RestartPolicy(**{**EAGER, "max_restarts": 100}))
    actors = procs.spawn("actors", ra.Phoenix, "t")
    failed = 0
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(40):
            old = pid_of(actors, 1)
            in_flight = actors.park.call(T, rank=1)
            kill(old)
            with pytest.raises(SupervisionError):
                in_flight.get(timeout=T)
            try:
                pid_of(actors, 1)
            except SupervisionError:
                failed += 1
                new_pid(actors, 1, old)
    finally:
        sys.setswitchinterval(interval)
    assert failed == 0, f"{failed} of 40 calls made right after the failure report failed"
    assert recorder.events == []


def test_policy_restarts_a_hung_rank(meshes: Meshes) -> None:
    procs, recorder = meshes(
        1, restart=RestartPolicy(**EAGER), heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6
    )
    actors = procs.spawn("actors", ra.Phoenix, "t")
    old = pid_of(actors, 0)
    os.kill(old, signal.SIGSTOP)
    try:
        replaced = new_pid(actors, 0, old)
    finally:
        with contextlib.suppress(OSError):
            os.kill(old, signal.SIGCONT)
    assert actors.info.call_one().get(timeout=T)["restart_count"] >= 1
    wait_gone([old])
    assert replaced != old and recorder.events == []


EXPECTED_RESTARTED = {  # 4 ranks, rank 1 fails
    "one_for_one": {1},
    "one_for_all": {0, 1, 2, 3},
    "rest_for_one": {1, 2, 3},
}


@pytest.mark.parametrize("strategy", list(EXPECTED_RESTARTED))
def test_strategy_restarts_the_right_ranks(meshes: Meshes, strategy: str) -> None:
    procs, recorder = meshes(4, restart=RestartPolicy(strategy=strategy, **EAGER))  # type: ignore[arg-type]
    actors = procs.spawn("actors", ra.Phoenix, "t")
    actors.incr.call(1).get(timeout=T)
    before = pids_of(actors)
    kill(before[1])
    expected = EXPECTED_RESTARTED[strategy]
    after, _ = retry(
        lambda: infos(actors), lambda got: all(got[r]["pid"] != before[r] for r in expected)
    )
    for rank, item in enumerate(after):
        if rank in expected:
            assert item["pid"] != before[rank], rank
            assert (item["restart_count"], item["counter"]) == (1, 0), rank
        else:
            assert item["pid"] == before[rank], rank
            assert (item["restart_count"], item["counter"]) == (0, 1), rank
    assert recorder.events == []
    # Whether the replaced procs are gone is test_strategy_stops_the_procs_it_replaces' job.
    meshes.checked_elsewhere.update(before[r] for r in expected)


@pytest.mark.parametrize("strategy", list(EXPECTED_RESTARTED))
def test_strategy_stops_the_procs_it_replaces(meshes: Meshes, strategy: str) -> None:
    """one_for_all / rest_for_one: the healthy procs that are restarted with the failed one
    are stopped first, not left running beside their replacements."""
    procs, recorder = meshes(3, restart=RestartPolicy(strategy=strategy, **EAGER))  # type: ignore[arg-type]
    actors = procs.spawn("actors", ra.Phoenix, "t")
    before = pids_of(actors)
    kill(before[1])
    expected = {r for r in EXPECTED_RESTARTED[strategy] if r < 3}
    retry(lambda: pids_of(actors), lambda got: all(got[r] != before[r] for r in expected))
    wait_gone([before[r] for r in sorted(expected)])
    assert recorder.events == []


def test_one_for_all_restarts_once_for_failures_of_one_incident(meshes: Meshes) -> None:
    """Two ranks die together: the whole mesh is restarted once, not once per dead rank."""
    procs, recorder = meshes(
        3, restart=RestartPolicy(strategy="one_for_all", backoff_s=0.3, **EAGER)
    )
    actors = procs.spawn("actors", ra.Phoenix, "t")
    before = pids_of(actors)
    kill(before[0])
    kill(before[1])
    after, _ = retry(lambda: infos(actors), lambda got: all(i["pid"] not in before for i in got))
    assert [i["restart_count"] for i in after] == [1, 1, 1]
    # A second restart would come one backoff after the second failure: watch past that.
    watch_until = time.monotonic() + 1.0
    while time.monotonic() < watch_until:
        try:
            now = infos(actors)
        except SupervisionError as exc:
            raise AssertionError(f"the mesh was restarted again: {exc}") from None
        assert [(i["pid"], i["restart_count"]) for i in now] == [(i["pid"], 1) for i in after], (
            "the mesh was restarted again"
        )
    assert recorder.events == []
    meshes.checked_elsewhere.add(before[2])  # see test_strategy_stops_the_procs_it_replaces


@pytest.mark.parametrize("where", ["same_rank", "any_rank"])
def test_too_many_restarts_escalate(meshes: Meshes, where: str) -> None:
    """More than max_restarts within within_s: the failure reaches the handler, marked as
    not restarted (the limit counts restarts of the whole mesh). A respawn by hand still
    works afterwards."""
    procs, recorder = meshes(2, restart=RestartPolicy(max_restarts=2, within_s=60, jitter=0))
    actors = procs.spawn("actors", ra.Phoenix, "t")
    victims = [1, 1, 1] if where == "same_rank" else [0, 1, 0]
    for n, rank in enumerate(victims[:2], start=1):
        old = pid_of(actors, rank)
        kill(old)
        new_pid(actors, rank, old)
        assert recorder.events == [], n
    last = victims[2]
    old = pid_of(actors, last)
    kill(old)
    (event,) = recorder.wait(1)
    assert (event.kind, event.signal, event.pid) == ("signal", "SIGKILL", old)
    assert dict(event.rank or {}) == {"gpus": last}
    assert "not restarted" in event.message and "more than 2 restarts within 60" in event.message
    assert "not restarted" in str(event)
    with pytest.raises(SupervisionError):
        actors.slice(gpus=last).info.call_one().get(timeout=T)
    assert actors.slice(gpus=1 - last).info.call_one().get(timeout=T)["pid"] > 0
    procs.respawn().get(timeout=T)
    assert actors.slice(gpus=last).info.call_one().get(timeout=T)["pid"] not in (old, None)
    assert len(recorder.events) == 1


def test_temporary_never_restarts(meshes: Meshes) -> None:
    procs, recorder = meshes(2, restart=RestartPolicy(restart="temporary", **EAGER))
    actors = procs.spawn("actors", ra.Phoenix, "t")
    before = pids_of(actors)
    kill(before[1])
    (event,) = recorder.wait(1)
    assert (event.kind, event.pid) == ("signal", before[1])
    assert "not restarted" in event.message and "temporary" in event.message
    with pytest.raises(SupervisionError):
        actors.slice(gpus=1).info.call_one().get(timeout=T)
    # An actor that fails on a running proc is not rebuilt either.
    actors.fail.broadcast("x", rank=0)
    second = recorder.wait(2)[1]
    assert second.kind == "exception" and "not restarted" in second.message
    with pytest.raises(SupervisionError):
        actors.slice(gpus=0).info.call_one().get(timeout=T)


def test_transient_restarts_failures_but_not_a_clean_exit(meshes: Meshes) -> None:
    procs, recorder = meshes(3, restart=RestartPolicy(restart="transient", **EAGER))
    actors = procs.spawn("actors", ra.Phoenix, "t")
    before = pids_of(actors)
    with pytest.raises(SupervisionError):
        actors.exit.call(0, rank=1).get(timeout=T)
    (event,) = recorder.wait(1)
    assert (event.kind, event.exit_code, event.pid) == ("exit", 0, before[1])
    assert "not restarted" in event.message and "transient" in event.message
    with pytest.raises(SupervisionError):
        actors.slice(gpus=1).info.call_one().get(timeout=T)
    kill(before[0])  # a signal is a failure
    new_pid(actors, 0, before[0])
    with pytest.raises(SupervisionError):  # so is a non-zero exit code
        actors.exit.call(3, rank=2).get(timeout=T)
    new_pid(actors, 2, before[2])
    assert len(recorder.events) == 1


def test_permanent_restarts_even_a_clean_exit(meshes: Meshes) -> None:
    procs, recorder = meshes(2, restart=RestartPolicy(**EAGER))
    actors = procs.spawn("actors", ra.Phoenix, "t")
    before = pids_of(actors)
    with pytest.raises(SupervisionError):
        actors.exit.call(0, rank=0).get(timeout=T)
    new_pid(actors, 0, before[0])
    assert recorder.events == []


def test_backoff_grows_within_a_burst(meshes: Meshes) -> None:
    """Delays of 0.5, 1 and 2 s: each re-spawn comes no sooner than its delay. Only these lower
    bounds are asserted: the time a re-spawn itself takes on a busy machine (0.5 to 1 s) moves
    ratios of the measured times (1.15 s after 0.95 s at load 20), while a delay that did not
    grow would need a re-spawn of 1.5 s to reach the third bound."""
    procs, recorder = meshes(2, restart=RestartPolicy(backoff_s=0.5, backoff_max_s=5.0, **EAGER))
    actors = procs.spawn("actors", ra.Phoenix, "t")
    took = []
    for _ in range(3):
        old = pid_of(actors, 1)
        start = time.monotonic()
        kill(old)
        new_pid(actors, 1, old)
        took.append(time.monotonic() - start)
    first, second, third = took
    assert first >= 0.5 and second >= 1.0 and third >= 2.0, took
    assert actors.slice(gpus=1).info.call_one().get(timeout=T)["restart_count"] == 3
    assert recorder.events == []


def test_policy_rebuilds_just_the_actor_that_failed_on_a_running_proc(meshes: Meshes) -> None:
    procs, recorder = meshes(2, restart=RestartPolicy(**EAGER))
    actors = procs.spawn("actors", ra.Phoenix, "t", scale=5)
    other = procs.spawn("other", ra.Phoenix, "o")
    actor_recorder = Recorder()
    actors.on_failure(actor_recorder)
    actors.incr.call(2).get(timeout=T)
    other.incr.call(3).get(timeout=T)
    pids = pids_of(actors)
    actors.fail.broadcast("x", rank=1)
    rebuilt, _ = retry(
        lambda: actors.slice(gpus=1).info.call_one().get(timeout=T),
        lambda i: i["restart_count"] == 1,
    )
    assert (rebuilt["pid"], rebuilt["counter"], rebuilt["scale"]) == (pids[1], 0, 5)
    assert [(i["pid"], i["restart_count"], i["counter"]) for i in infos(actors)] == [
        (pids[0], 0, 2),
        (pids[1], 1, 0),
    ]
    assert [(i["pid"], i["restart_count"], i["counter"]) for i in infos(other)] == [
        (pids[0], 0, 3),
        (pids[1], 0, 3),
    ]
    assert recorder.events == [] and actor_recorder.events == []


def test_a_constructor_that_always_raises_escalates_after_max_restarts(meshes: Meshes) -> None:
    procs, recorder = meshes(2, restart=RestartPolicy(max_restarts=2, within_s=60, jitter=0))
    actors = procs.spawn("actors", fa.Fragile, fail_in_init=True, fail_on_rank=1)
    (event,) = recorder.wait(1)
    assert event.kind == "exception" and "constructor" in event.message
    assert "not restarted" in event.message and "more than 2 restarts" in event.message
    assert dict(event.rank or {}) == {"gpus": 1}
    with pytest.raises(SupervisionError):
        actors.slice(gpus=1).ping.call_one().get(timeout=T)
    assert actors.slice(gpus=0).ping.call_one().get(timeout=T) == 0
    assert len(recorder.events) == 1


def test_stopping_a_mesh_during_a_restart_backoff(meshes: Meshes) -> None:
    """stop() while a restart waits out its backoff: the stop completes, the waiting calls
    fail, and the pending restart does not bring the proc back afterwards."""
    backoff = 1.0
    procs, recorder = meshes(2, restart=RestartPolicy(backoff_s=backoff, **EAGER))
    actors = procs.spawn("actors", ra.Phoenix, "t")
    before = pids_of(actors)
    in_flight = actors.park.call(T, rank=1)
    kill(before[1])
    with pytest.raises(SupervisionError):
        in_flight.get(timeout=T)
    detected = time.monotonic()
    waiting = actors.slice(gpus=1).info.call_one()
    meshes.forget(procs)
    stopped = procs.stop()
    problems = []
    try:
        stopped.get(timeout=3.0)
    except TimeoutError:
        problems.append("stop() of a mesh whose rank waits to be restarted never finished")
    # Watch until well past the backoff: no new proc of this mesh may appear.
    appeared: set[int] = set()
    watch_until = max(detected + backoff + 1.0, time.monotonic() + 0.2)
    while time.monotonic() < watch_until:
        appeared |= meshes.strays() - set(before)
        time.sleep(0.02)
    if appeared:
        problems.append(f"procs {sorted(appeared)} were re-spawned after the mesh was stopped")
    assert not problems, problems
    with pytest.raises(SupervisionError, match="stopped"):
        waiting.get(timeout=T)
    assert recorder.events == []


def test_a_handle_held_by_another_actor_follows_a_respawn(meshes: Meshes) -> None:
    """Handles held elsewhere heal too: the agent tells the holders of a handle to a
    re-spawned proc where the rank lives now."""
    import actors

    targets, recorder = meshes(2, name="targets")
    echo = targets.spawn("echo", actors.Echo)
    callers, _ = meshes(1, name="callers")
    caller = callers.spawn("caller", actors.Caller, echo)
    assert caller.call_stored.call_one(1).get(timeout=T) == [1, 1]
    pid = echo.slice(gpus=1).pid.call_one().get(timeout=T)
    kill(pid)
    recorder.wait()
    with pytest.raises(ActorError):  # the holder hears of the death like the owner
        caller.call_stored.call_one(2).get(timeout=T)
    targets.respawn().get(timeout=T)
    # The holder hears of the new proc from the agent, on another channel than the owner's
    # ready message, so it follows a few milliseconds later at most.
    result, _ = retry(lambda: caller.call_stored.call_one(3).get(timeout=T))
    assert result == [3, 3]
    assert echo.slice(gpus=1).pid.call_one().get(timeout=T) != pid
