"""The call watchdog: a call that runs past its limit (a deadlock heartbeats cannot see) is
"stuck": its caller gets a `SupervisionError`, its owner the event with the stack where it
waits, and its proc is killed as a hung one's, so that a `RestartPolicy` replaces it.

Real procs, real deadlocks (`stuck_actors`): a lock taken twice, a queue nobody fills, an event
nobody sets. Limits are 1 s; waits are bounded by `T`, far above it, and timings are asserted
only as lower bounds. Every proc mesh has a recording ``on_failure`` handler or a restart
policy, and nothing may reach the root (`no_failure_reaches_the_root`).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import failing_actors as fa
import pytest
import stuck_actors as sa
from conftest import RUN_BASE
from hypothesis import given, settings
from hypothesis import strategies as st
from polling import pid_alive, wait_until
from recording import Recorder
from test_failfast import RUN_TIMEOUT_S, Outcome, client_env, run_dirs

from mesh import Actor, ActorMesh, Settings, concurrent_endpoint, configured, endpoint
from supervision import RestartPolicy, SupervisionError

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("no_failure_reaches_the_root")]

T = 30.0  # the bound on every wait (never reached when things work)
EAGER = RestartPolicy(jitter=0.0, max_restarts=10, within_s=60.0)

#: Each way to get stuck, and the function its traceback must name.
DEADLOCKS = {
    "wait_on_lock": "in wait_on_lock",
    "wait_on_queue": "in wait_on_queue",
    "wait_on_event": "in wait_on_event",  # async: the task's chain of coroutines
    "block_the_loop": "in block_the_loop",  # async, holding the loop: the loop thread's stack
    "wait_concurrently": "in wait_concurrently",  # a concurrent endpoint, its own thread
}


def stuck_call(actors: ActorMesh[Any], endpoint_name: str, *args: Any) -> SupervisionError:
    """Call `endpoint_name` on rank 0; it must fail as stuck, no sooner than its limit."""
    started = time.monotonic()
    with pytest.raises(SupervisionError) as raised:
        getattr(actors.slice(gpus=0), endpoint_name).call_one(*args).get(timeout=T)
    assert time.monotonic() - started >= sa.LIMIT_S
    event = raised.value.event
    assert event.kind == "stuck", event
    assert "ran past its time limit" in str(raised.value)
    assert f"endpoint {endpoint_name!r}" in event.message
    return raised.value


def answered_by_new_proc(actors: ActorMesh[Any], old_pid: int) -> int:
    """Wait until rank 0 answers from a proc other than `old_pid` (a restart replaced it)."""
    found: list[int] = []

    def replaced() -> bool:
        try:
            found[:] = [actors.slice(gpus=0).pid.call_one().get(timeout=T)]
        except SupervisionError:  # the old proc's failure, or the restart under way
            return False
        return found[0] != old_pid

    wait_until(replaced, T, "rank 0 answering from a new proc")
    return found[0]


# -- a stuck call fails, its proc is replaced --------------------------------------------------


@pytest.mark.parametrize("endpoint_name", list(DEADLOCKS))
def test_a_deadlocked_call_fails_its_caller_and_a_restart_policy_replaces_the_proc(
    make_procs: Callable[..., Any], endpoint_name: str
) -> None:
    procs = make_procs({"gpus": 2}, restart=EAGER)
    recorder = Recorder()
    procs.on_failure(recorder)
    actors = procs.spawn("stuck", sa.Stuck)
    old_pid, other_pid = actors.pid.call().get(timeout=T).values()
    error = stuck_call(actors, endpoint_name)
    assert DEADLOCKS[endpoint_name] in (error.event.traceback or "")
    assert error.event.pid == old_pid and dict(error.event.rank or {}) == {"gpus": 0}
    new_pid = answered_by_new_proc(actors, old_pid)
    assert new_pid != old_pid
    assert actors.slice(gpus=0).restart_count.call_one().get(timeout=T) == 1
    wait_until(lambda: not pid_alive(old_pid), T, "the stuck proc to be killed")
    assert actors.slice(gpus=1).pid.call_one().get(timeout=T) == other_pid  # untouched
    assert recorder.events == []  # the policy handled it


def test_without_a_policy_the_owner_hears_of_the_stuck_call_with_its_stack(
    make_procs: Callable[..., Any],
) -> None:
    procs = make_procs({"gpus": 1})
    by_procs, by_actors = Recorder(), Recorder(decision=False)  # the actors' declines
    procs.on_failure(by_procs)
    actors = procs.spawn("stuck", sa.Stuck)
    actors.on_failure(by_actors)
    pid = actors.pid.call_one().get(timeout=T)
    caller_error = stuck_call(actors, "wait_on_queue")
    (event,) = by_actors.wait(1)
    assert event == caller_error.event  # the very event the caller got
    assert event.kind == "stuck" and event.mesh_name == "stuck" and event.pid == pid
    (about_proc,) = by_procs.wait(1)  # the same failure, naming the proc mesh
    assert about_proc == dataclasses.replace(event, mesh_name=procs.name)
    assert "wait_on_queue" in (event.traceback or "") and "queue.py" in (event.traceback or "")
    wait_until(lambda: not pid_alive(pid), T, "the stuck proc to be killed")
    with pytest.raises(SupervisionError):
        actors.pid.call_one().get(timeout=T)


def test_an_owner_actor_decides_about_a_stuck_child_in_its_supervise(
    make_procs: Callable[..., Any], tmp_path: Path
) -> None:
    procs = make_procs({"gpus": 1})
    procs.on_failure(Recorder())
    owner = procs.spawn("owner", fa.SyncOwner, str(tmp_path / "record"), "handle")
    owner.spawn_child.call_one("child", 1, sa.Stuck).get(timeout=T)
    outcome = owner.call_child.call_one("child", "wait_on_lock").get(timeout=T)
    assert outcome[:2] == ("SupervisionError", "stuck")
    seen: list[Any] = []
    wait_until(
        lambda: bool(seen.extend(owner.seen_events.call_one().get(timeout=T)) or seen),
        T,
        "the owner's __supervise__ to hear of the stuck child",
    )
    assert [e.kind for e in seen] == ["stuck"]
    assert seen[0].mesh_name == "child" and "in wait_on_lock" in (seen[0].traceback or "")


# -- what is not stuck -------------------------------------------------------------------------


def test_callers_that_do_not_own_the_proc_hear_why_it_was_stopped(
    make_procs: Callable[..., Any],
) -> None:
    """Callers in another proc (they hold handles, not the procs): the stuck call's caller
    gets the "stuck" event; a call to another actor on the killed proc ends "stopped", with
    the owner's reason (the stuck actor) rather than a bare "stopped by its owner"."""
    procs = make_procs({"gpus": 2})
    recorder = Recorder()
    procs.on_failure(recorder)
    stuck, others = (procs.slice(gpus=0).spawn(name, sa.Stuck) for name in ("stuck", "others"))
    for actors in (stuck, others):
        actors.on_failure(recorder)
    first, second = (procs.slice(gpus=1).spawn(name, sa.StuckCaller) for name in ("c1", "c2"))
    stuck_call = first.call.call_one(stuck, "wait_on_lock")
    other_call = second.call.call_one(others, "sleep_unlimited", 10 * T)
    outcome = stuck_call.get(timeout=T)
    assert outcome.startswith("FAILED stuck:") and "'wait_on_lock'" in outcome, outcome
    outcome = other_call.get(timeout=T)
    assert outcome.startswith("FAILED stopped:"), outcome
    assert "stopped by its owner, because actor stuck-" in outcome, outcome
    assert "was stuck: endpoint 'wait_on_lock' was still running" in outcome, outcome


def test_calls_within_their_limit_and_unlimited_ones_run_to_their_end(
    make_procs: Callable[..., Any],
) -> None:
    procs = make_procs({"gpus": 1})
    recorder = Recorder()
    procs.on_failure(recorder)
    actors = procs.spawn("fine", sa.Stuck)
    pid = actors.pid.call_one().get(timeout=T)
    for seconds in (0.0, 0.1, 2 * sa.LIMIT_S):  # its limit is 10 * LIMIT_S
        assert actors.sleep.call_one(seconds).get(timeout=T) == seconds
    assert actors.sleep_unlimited.call_one(3 * sa.LIMIT_S).get(timeout=T) == 3 * sa.LIMIT_S
    assert actors.pid.call_one().get(timeout=T) == pid and recorder.events == []


def test_a_suspended_watchdog_does_not_judge_the_paused_call(
    make_procs: Callable[..., Any],
) -> None:
    procs = make_procs({"gpus": 1})
    recorder = Recorder()
    procs.on_failure(recorder)
    actors = procs.spawn("paused", sa.Stuck)
    assert actors.pause.call_one(4 * sa.LIMIT_S).get(timeout=T) == "resumed"  # limit: 2 s
    assert recorder.events == []
    stuck_call(actors, "wait_on_lock")  # the watch goes on afterwards
    recorder.wait(1)


# -- which limit applies -----------------------------------------------------------------------


def test_the_endpoint_limit_overrides_the_class_and_the_class_the_setting(
    make_procs: Callable[..., Any],
) -> None:
    procs = make_procs({"gpus": 1}, restart=EAGER)
    procs.on_failure(Recorder())
    by_class = procs.spawn("by-class", sa.StuckByClass)
    assert by_class.sleep_exempt.call_one(3 * sa.LIMIT_S).get(timeout=T) == 3 * sa.LIMIT_S
    stuck_call(by_class, "sleep_unlimited", 3 * sa.LIMIT_S)  # the class's limit applies


def test_the_setting_in_force_at_spawn_limits_that_mesh_only(
    make_procs: Callable[..., Any],
) -> None:
    procs = make_procs({"gpus": 1}, restart=EAGER)
    recorder = Recorder()
    procs.on_failure(recorder)
    with configured(call_limit_s=sa.LIMIT_S):
        limited = procs.spawn("limited", sa.Stuck)
        exempt = procs.spawn("exempt", sa.StuckByClass)
        unlimited = procs.spawn("unlimited", sa.Unlimited)
    free = procs.spawn("free", sa.Stuck)
    assert free.sleep_unlimited.call_one(3 * sa.LIMIT_S).get(timeout=T) == 3 * sa.LIMIT_S
    assert exempt.sleep_exempt.call_one(3 * sa.LIMIT_S).get(timeout=T) == 3 * sa.LIMIT_S
    assert unlimited.sleep_unlimited.call_one(3 * sa.LIMIT_S).get(timeout=T) == 3 * sa.LIMIT_S
    stuck_call(limited, "sleep_unlimited", 3 * sa.LIMIT_S)
    assert recorder.events == []


# -- bad values are refused where they are written ---------------------------------------------

BAD_LIMITS = [0, -1.0, math.nan, -math.inf, "10", True, [1.0]]


@pytest.mark.parametrize("bad", BAD_LIMITS)
def test_bad_limits_are_refused_at_definition(bad: Any) -> None:
    error = TypeError if isinstance(bad, (str, bool, list)) else ValueError
    with pytest.raises(error, match="call_limit_s"):
        endpoint(call_limit_s=bad)
    with pytest.raises(error, match="call_limit_s"):
        concurrent_endpoint(call_limit_s=bad)
    with pytest.raises(error, match=r"actor class .*Bad sets call_limit_s"):

        class Bad(Actor):
            call_limit_s = bad


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "10", True])
def test_bad_settings_are_refused(bad: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="call_limit_s"):
        Settings(call_limit_s=bad)


def test_the_environment_variable_sets_the_default_and_a_bad_one_is_named() -> None:
    assert Settings.from_env({"MESHVISOR_CALL_LIMIT_S": "90"}).call_limit_s == 90.0
    assert Settings.from_env({}).call_limit_s is None
    with pytest.raises(ValueError, match="MESHVISOR_CALL_LIMIT_S"):
        Settings.from_env({"MESHVISOR_CALL_LIMIT_S": "soon"})


@given(st.one_of(st.floats(allow_nan=True), st.integers(-(10**6), 10**6)))
@settings(deadline=None)
def test_a_limit_is_accepted_exactly_when_it_is_a_positive_number(value: float) -> None:
    def step(self: Any) -> None: ...

    if value > 0:  # math.inf included: no limit
        assert endpoint(call_limit_s=value)(step).call_limit_s == value
        assert concurrent_endpoint(call_limit_s=value)(step).call_limit_s == value
    else:
        with pytest.raises(ValueError, match="call_limit_s"):
            endpoint(call_limit_s=value)


# -- at the root, with no handler --------------------------------------------------------------


@pytest.fixture
def xdg() -> Iterator[Path]:
    """The client's own short, private ``XDG_RUNTIME_DIR`` (as in test_failfast)."""
    path = Path(tempfile.mkdtemp(prefix="mvc-", dir=RUN_BASE))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_at_the_root_the_caller_that_caught_it_is_not_interrupted_again(xdg: Path) -> None:
    script = Path(__file__).parent / "scripts" / "stuck_client.py"
    outcome = Outcome(
        subprocess.run(
            [sys.executable, str(script)],
            env=client_env(xdg),
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            cwd=xdg,
        )
    )
    assert outcome.returncode == 0 and outcome.result is not None, outcome
    assert outcome.result["first"]["kind"] == "stuck"
    assert outcome.result["second"] is None, outcome
    wait_until(lambda: not any(pid_alive(p) for p in outcome.pids), T, "the job to exit")
    assert run_dirs(xdg) == []
