"""Supervision semantics, with real procs, real signals and real owner actors.

Everything here runs inside the pytest process, which is a meshvisor client whose fail-fast
would interrupt pytest's main thread. So every failure a test provokes is taken by a handler:
each proc mesh gets a recording ``on_failure`` handler, and an autouse guard installs a global
unhandled-failure hook that records (and so swallows) anything else. The guard fails the test
if an unexpected failure reached it. Fail-fast itself is tested in test_failfast.py.

Negative checks ("the owner got no event") use a *barrier* instead of a sleep: an ``await``ed
call from async code is answered to the client's main inbox, behind everything the same proc
sent there before (FIFO per sender), and the client's event loop thread runs handlers in
arrival order; so once the barrier returns, any earlier failure report has been handled.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import actors
import anyio
import failing_actors as fa
import pytest
from polling import pid_alive, wait_gone, wait_until
from recording import Recorder

from mesh import ActorMesh, ProcMesh
from mesh.testing import probe
from supervision import ActorError, SupervisionError, SupervisionEvent

pytestmark = pytest.mark.usefixtures("no_failure_reaches_the_root")
T = 30.0  # the bound on every wait (never reached when things work)
FAST_HB = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0}


# -- helpers ------------------------------------------------------------------------------------


def barrier(mesh: ActorMesh[Any]) -> None:
    """Wait until the client has handled everything the procs of `mesh` sent before now."""

    async def ping() -> None:
        await mesh.aping.call()

    anyio.run(ping)


class Watched:
    """A proc mesh with a recording handler, a `Fragile` mesh and a healthy probe mesh."""

    def __init__(
        self, procs: ProcMesh, recorder: Recorder, actors: ActorMesh[Any], probe: ActorMesh[Any]
    ) -> None:
        self.procs, self.recorder, self.actors, self.probe = procs, recorder, actors, probe
        self.pids: list[int] = list(probe.pid.call().get(timeout=T).values())


@pytest.fixture
def watched(make_procs: Callable[..., Any]) -> Callable[..., Watched]:
    """Factory: `watched(n, name, actor kwargs..., hb=False)`."""

    def make(n: int = 2, name: str = "workers", hb: bool = False, **actor_kwargs: Any) -> Watched:
        procs = make_procs({"gpus": n}, name=name, **(FAST_HB if hb else {}))
        recorder = Recorder()
        procs.on_failure(recorder)
        actors = procs.spawn(f"{name}-actors", fa.Fragile, **actor_kwargs)
        probe = procs.spawn(f"{name}-probe", fa.Fragile)
        return Watched(procs, recorder, actors, probe)

    return make


def assert_names_where(event: SupervisionEvent, mesh: str, rank: int, pid: int) -> None:
    """`str(event)` is one sentence naming mesh, rank, pid and host."""
    text = str(event)
    assert f'"{mesh}"' in text
    assert f"{{'gpus': {rank}}}" in text
    assert str(pid) in text
    assert socket.gethostname() in text
    assert text.endswith(".") and "\n" not in text


def assert_told_about_the_actor(
    event: SupervisionEvent, proc_event: SupervisionEvent, actors: str, rank: int
) -> None:
    """`event` tells of a proc's death to someone concerned with actor mesh `actors`: it names
    that mesh and the actor at `rank`; `proc_event` (what the proc mesh's handler heard) names
    the proc mesh. Both say which process ended, and how."""
    assert event.mesh_name == actors and dict(event.rank or {}) == {"gpus": rank}
    assert event.actor_id is not None and event.actor_id.startswith(f"{actors}-")
    assert event.actor_id.endswith(f"[{rank}]")
    assert proc_event.mesh_name != actors and proc_event.actor_id is None
    same = ("kind", "proc_id", "pid", "host", "exit_code", "signal", "message", "time")
    assert {f: getattr(event, f) for f in same} == {f: getattr(proc_event, f) for f in same}


# -- an endpoint raising an Exception: only the call fails ------------------------------------


def _call(actors: ActorMesh[Any], adverb: str) -> Any:
    """Make the actor at rank 1 raise through `adverb`; return the error the caller got."""
    with pytest.raises(ActorError) as info:
        if adverb == "call":
            actors.raise_error.call("bad input", rank=1).get(timeout=T)
        elif adverb == "call_one":
            actors.slice(gpus=1).raise_error.call_one("bad input").get(timeout=T)
        elif adverb == "choose":
            actors.slice(gpus=slice(1, 2)).raise_error.choose("bad input").get(timeout=T)
        elif adverb == "stream":
            outcomes = []
            for future in actors.raise_error.stream("bad input", rank=1):
                try:
                    outcomes.append(future.get(timeout=T))
                except ActorError as exc:
                    outcomes.append(exc)
            assert 0 in outcomes and len(outcomes) == 2
            raise next(o for o in outcomes if isinstance(o, ActorError))
    return info.value


@pytest.mark.parametrize("adverb", ["call", "call_one", "choose", "stream"])
def test_endpoint_exception_fails_only_the_call(
    watched: Callable[..., Watched], adverb: str
) -> None:
    w = watched()
    error = _call(w.actors, adverb)
    assert isinstance(error, fa.EndpointError) and isinstance(error, ValueError)
    assert not isinstance(error, SupervisionError)
    assert "bad input" in str(error) and "EndpointError" in str(error)
    assert error.mesh_name == "workers-actors"
    assert dict(error.rank or {}) == {"gpus": 1}
    assert error.pid == w.pids[1]
    assert "raise_error" in error.remote_traceback
    assert "EndpointError: bad input" in error.remote_traceback
    # The actor survived, with its state: the failed call counted.
    assert w.actors.slice(gpus=1).count.call_one().get(timeout=T) == 1
    assert w.actors.ping.call().get(timeout=T).values() == (0, 1)
    barrier(w.probe)
    assert w.recorder.events == []


def test_async_endpoint_exception_keeps_its_type(watched: Callable[..., Watched]) -> None:
    w = watched()
    with pytest.raises(KeyError) as info:
        w.actors.slice(gpus=0).araise_error.call_one("missing").get(timeout=T)
    assert isinstance(info.value, ActorError)
    assert "araise_error" in info.value.remote_traceback
    assert w.actors.aping.call().get(timeout=T).values() == (0, 1)
    barrier(w.probe)
    assert w.recorder.events == []


def test_owner_is_not_told_of_an_endpoint_exception(
    make_procs: Callable[..., Any], tmp_path: Path
) -> None:
    record = tmp_path / "record.jsonl"
    procs = make_procs({"gpus": 1}, name="top")
    owner = procs.spawn("owner", fa.SyncOwner, str(record), "ignore")
    owner.spawn_child.call_one("kids", 2).get(timeout=T)
    outcome = owner.call_child.call_one("kids", "raise_error", "x", rank=0)
    with pytest.raises(ActorError, match="EndpointError: x"):
        outcome.get(timeout=T)
    # The owner handled the reply after any failure report from the same proc; it is
    # alive (it would have escalated, declining), and its handler never ran.
    assert owner.seen_events.call_one().get(timeout=T) == []
    assert owner.call_child.call_one("kids", "ping").get(timeout=T) == ("ok", [0, 1])
    assert not record.exists()


def test_nested_actor_error_keeps_the_original_type(
    make_procs: Callable[..., Any], tmp_path: Path
) -> None:
    """An error relayed through an owner is still ``except ValueError``-able at the client."""
    procs = make_procs({"gpus": 1}, name="top")
    owner = procs.spawn("owner", fa.SyncOwner, str(tmp_path / "record.jsonl"))
    owner.spawn_child.call_one("kids", 1).get(timeout=T)
    with pytest.raises(ActorError) as info:
        owner.relay_child.call_one("kids", "raise_error", "deep").get(timeout=T)
    assert "EndpointError: deep" in str(info.value)
    assert isinstance(info.value, ValueError), type(info.value).__mro__


# -- failures of the actor: broadcast raising, BaseException, __init__ -------------------------


def _assert_actor_failed(
    w: Watched, rank: int, *, mesh: str = "workers-actors"
) -> SupervisionEvent:
    """Exactly one event for `rank`; later calls to it fail; everything else still answers."""
    (event,) = w.recorder.wait(1)
    assert isinstance(event, SupervisionEvent)
    assert event.kind == "exception" and event.cause is None
    assert event.proc_id and abs(event.time - time.time()) < 60
    assert event.mesh_name == mesh
    assert dict(event.rank or {}) == {"gpus": rank}
    assert event.pid == w.pids[rank] and event.actor_id
    assert event.host == socket.gethostname()
    assert_names_where(event, mesh, rank, w.pids[rank])
    with pytest.raises(SupervisionError) as info:
        w.actors.slice(gpus=rank).ping.call_one().get(timeout=T)
    assert info.value.event.kind == "exception"
    with pytest.raises(SupervisionError):
        w.actors.ping.call().get(timeout=T)
    other = 1 - rank
    assert w.actors.slice(gpus=other).ping.call_one().get(timeout=T) == 0
    # Only the actor failed: its proc (and the probe actor on it) lives on.
    assert w.probe.ping.call().get(timeout=T).values() == (0, 1)
    barrier(w.probe)
    assert len(w.recorder.events) == 1, "the owner must be told once"
    return event


def test_broadcast_that_raises_fails_the_actor(watched: Callable[..., Watched]) -> None:
    w = watched()
    w.actors.raise_error.broadcast("nobody to reply to", rank=1)
    event = _assert_actor_failed(w, 1)
    assert "broadcast" in event.message and "raise_error" in event.message
    assert "EndpointError: nobody to reply to" in (event.traceback or "")


@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt", "FatalError", "async"])
def test_base_exception_in_endpoint_fails_the_actor(
    watched: Callable[..., Watched], kind: str
) -> None:
    w = watched()
    with pytest.raises(SupervisionError) as info:
        if kind == "async":
            w.actors.slice(gpus=0).araise_base.call_one().get(timeout=T)
        else:
            w.actors.slice(gpus=0).raise_base.call_one(kind).get(timeout=T)
    assert not isinstance(info.value, ActorError)
    event = _assert_actor_failed(w, 0)
    assert info.value.event == event
    expected = "SystemExit" if kind == "async" else kind
    assert expected in event.message and expected in str(info.value)


@pytest.mark.parametrize("base", [False, True], ids=["Exception", "BaseException"])
def test_constructor_that_raises_fails_the_actor(
    watched: Callable[..., Watched], base: bool
) -> None:
    w = watched(fail_in_init=True, fail_on_rank=1, base_in_init=base)
    with pytest.raises(SupervisionError) as info:
        w.actors.ping.call().get(timeout=T)
    assert info.value.event.kind == "exception"
    event = _assert_actor_failed(w, 1)
    assert "constructor" in event.message
    name = "FatalError" if base else "ConstructorError"
    assert name in event.message and name in (event.traceback or "")


# -- the process dies ---------------------------------------------------------------------------

DEATHS = {
    # how: (endpoint call that kills rank 1 | None: SIGKILL from outside, expected fields)
    "exit0": (lambda a: a.exit.call(0, rank=1), {"kind": "exit", "exit_code": 0}),
    "exit3": (lambda a: a.exit.call(3, rank=1), {"kind": "exit", "exit_code": 3}),
    "sigterm": (
        lambda a: a.kill_self.call("SIGTERM", rank=1),
        {"kind": "signal", "signal": "SIGTERM"},
    ),
    "segfault": (lambda a: a.segfault.call(rank=1), {"kind": "signal", "signal": "SIGSEGV"}),
    "sigsegv_self": (
        lambda a: a.kill_self.call("SIGSEGV", rank=1),
        {"kind": "signal", "signal": "SIGSEGV"},
    ),
    "sigkill_self": (
        lambda a: a.kill_self.call("SIGKILL", rank=1),
        {"kind": "signal", "signal": "SIGKILL"},
    ),
    "sigkill_outside": (None, {"kind": "signal", "signal": "SIGKILL"}),
}


@pytest.mark.parametrize("how", list(DEATHS))
def test_process_death_fails_calls_at_once(watched: Callable[..., Watched], how: str) -> None:
    w = watched()
    kill, expected = DEATHS[how]
    if kill is None:
        in_flight = w.actors.park.call(T, rank=1)  # only a failure can end it early
        os.kill(w.pids[1], signal.SIGKILL)
    else:
        in_flight = kill(w.actors)
    # The in-flight call fails as soon as the agent reaps the proc, not after a timeout.
    with pytest.raises(SupervisionError) as info:
        in_flight.get(timeout=T / 3)
    event = info.value.event
    assert isinstance(event, SupervisionEvent)
    assert event.proc_id and abs(event.time - time.time()) < 60
    for field, value in expected.items():
        assert getattr(event, field) == value, (field, event)
    assert event.pid == w.pids[1] and event.host == socket.gethostname()
    assert_names_where(event, "workers-actors", 1, w.pids[1])
    reason = f"code {expected['exit_code']}" if "exit_code" in expected else expected["signal"]
    assert reason in str(event)
    assert str(event) in str(info.value)
    # Later calls that reach the dead rank fail at once: the future is failed when returned.
    for later in (
        w.actors.ping.call(),
        w.actors.slice(gpus=1).ping.call_one(),
        w.probe.slice(gpus=1).ping.call_one(),
    ):
        assert later.done()
        with pytest.raises(SupervisionError):
            later.get(timeout=0)
    # Other ranks and other meshes keep working.
    assert w.actors.slice(gpus=0).ping.call_one().get(timeout=T) == 0
    assert w.probe.slice(gpus=0).aping.call_one().get(timeout=T) == 0
    (reported,) = w.recorder.wait(1)
    assert reported.mesh_name == "workers"
    assert_told_about_the_actor(event, reported, "workers-actors", 1)
    # A kill is reported as the dying proc lets go of its memory, before it is reaped.
    wait_gone([w.pids[1]], T)


def test_a_sync_get_with_no_timeout_fails_when_its_proc_is_killed(
    watched: Callable[..., Watched],
) -> None:
    """A thread's get() with no timeout waits in one blocking receive on its reply inbox: the
    death of the called proc still ends it, as soon as the agent reaps the proc."""
    w = watched()
    sent, outcome = threading.Event(), []

    def call_and_wait() -> None:
        in_flight = w.actors.slice(gpus=1).park.call_one(T)  # only a failure can end it early
        sent.set()
        try:
            outcome.append(in_flight.get())
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call_and_wait, daemon=True)
    caller.start()
    assert sent.wait(T)
    time.sleep(0.5)  # let the thread reach its blocking receive (the test passes either way)
    os.kill(w.pids[1], signal.SIGKILL)
    caller.join(T / 3)
    assert not caller.is_alive(), "get() still waits after its proc was killed"
    (error,) = outcome
    assert isinstance(error, SupervisionError) and error.event.signal == "SIGKILL"
    w.recorder.wait(1)


def test_death_of_an_idle_process_is_reported(watched: Callable[..., Watched]) -> None:
    w = watched()
    os.kill(w.pids[0], signal.SIGKILL)
    (event,) = w.recorder.wait(1)
    assert (event.kind, event.signal, dict(event.rank or {})) == ("signal", "SIGKILL", {"gpus": 0})
    assert w.actors.slice(gpus=0).ping.call_one().done()
    assert w.actors.slice(gpus=1).ping.call_one().get(timeout=T) == 0


def test_actor_mesh_on_failure_hears_of_its_procs_dying(
    watched: Callable[..., Watched], root_events: list[Any]
) -> None:
    """A handler on an actor mesh is told when one of its actors dies with its proc."""
    w = watched()
    w.procs.on_failure(Recorder(decision=False))  # declines: the actor mesh handler decides
    actor_handler = Recorder()
    w.actors.on_failure(actor_handler)
    os.kill(w.pids[1], signal.SIGKILL)
    wait_until(lambda: actor_handler.events or root_events, what="any handler")
    root_events.clear()
    assert [e.kind for e in actor_handler.events] == ["signal"]


def test_each_handler_hears_of_a_proc_death_about_its_own_mesh(
    watched: Callable[..., Watched],
) -> None:
    """Actor mesh handlers hear of their actor, the proc mesh's handler of the proc, and a
    caller of an actor mesh gets its handler's event: the mesh and actor it called."""
    w = watched()
    on_actors, on_probe = Recorder(decision=False), Recorder(decision=False)
    w.actors.on_failure(on_actors)
    w.probe.on_failure(on_probe)
    in_flight = w.probe.park.call(T, rank=1)
    os.kill(w.pids[1], signal.SIGKILL)
    with pytest.raises(SupervisionError) as info:
        in_flight.get(timeout=T)
    (proc_event,) = w.recorder.wait(1)
    assert proc_event.mesh_name == "workers" and dict(proc_event.rank or {}) == {"gpus": 1}
    (actors_event,), (probe_event,) = on_actors.events, on_probe.events
    assert_told_about_the_actor(actors_event, proc_event, "workers-actors", 1)
    assert_told_about_the_actor(probe_event, proc_event, "workers-probe", 1)
    assert info.value.event == probe_event
    assert_names_where(probe_event, "workers-probe", 1, w.pids[1])
    assert "SIGKILL" in str(probe_event)


def test_actor_mesh_handler_comes_before_the_proc_mesh_handler(
    watched: Callable[..., Watched],
) -> None:
    w = watched()
    first, second = Recorder(decision=False), Recorder(decision=RuntimeError("broken"))
    w.actors.on_failure(first)
    w.probe.on_failure(second)  # another mesh: not consulted
    w.actors.raise_error.broadcast("x", rank=0)
    (proc_level,) = w.recorder.wait(1)  # the proc mesh handler takes what the first declined
    assert first.events == [proc_level]
    assert second.events == []


# -- hangs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["sigstop", "gil"])
def test_hung_process_is_killed_and_reported(watched: Callable[..., Watched], how: str) -> None:
    w = watched(hb=True)
    if how == "sigstop":
        in_flight = w.actors.park.call(T, rank=1)
        os.kill(w.pids[1], signal.SIGSTOP)
    else:
        in_flight = w.actors.hold_gil.call(60, rank=1)
    with pytest.raises(SupervisionError) as info:
        in_flight.get(timeout=T / 3)
    event = info.value.event
    assert event.kind == "hung"
    assert dict(event.rank or {}) == {"gpus": 1} and event.pid == w.pids[1]
    assert_names_where(event, "workers-actors", 1, w.pids[1])
    assert "heartbeat" in str(event)
    assert ("is stopped" if how == "sigstop" else "used no CPU time") in event.message
    (reported,) = w.recorder.wait(1)
    assert_told_about_the_actor(event, reported, "workers-actors", 1)
    wait_gone([w.pids[1]])  # the agent killed it
    assert w.actors.slice(gpus=0).ping.call_one().get(timeout=T) == 0


@pytest.mark.timeout(60)
def test_a_busy_proc_is_not_hung(make_procs: Callable[..., Any]) -> None:
    """A long C call that holds the GIL starves the heartbeat thread, but the proc keeps using
    CPU time: it is busy, not hung, and its call returns."""
    procs = make_procs({"gpus": 1}, **FAST_HB)
    recorder = Recorder()
    procs.on_failure(recorder)
    worker = procs.spawn("cruncher", actors.Sleeper)
    silent_s = worker.crunch.call_one(3 * FAST_HB["heartbeat_timeout_s"]).get(timeout=T)
    assert silent_s > FAST_HB["heartbeat_timeout_s"]  # CPU time: the silence was at least this
    assert worker.sleep.call_one(0).get(timeout=T) == "slept"
    assert recorder.events == []


@pytest.mark.timeout(60)
def test_a_proc_busy_past_its_busy_timeout_is_hung(make_procs: Callable[..., Any]) -> None:
    """Busy is no excuse forever: past `busy_timeout_s` without a heartbeat it is hung, and
    the event says it was busy."""
    procs = make_procs({"gpus": 1}, busy_timeout_s=3.0, **FAST_HB)
    recorder = Recorder()
    procs.on_failure(recorder)
    worker = procs.spawn("cruncher", actors.Sleeper)
    (pid,) = probe(worker).get(timeout=T).values()
    with pytest.raises(SupervisionError) as info:
        worker.crunch.call_one(600).get(timeout=T)
    event = info.value.event
    assert (event.kind, event.pid) == ("hung", pid)
    assert "kept using CPU time" in event.message and "busy_timeout_s (3 s)" in event.message
    (reported,) = recorder.wait(1)
    assert_told_about_the_actor(event, reported, "cruncher", 0)


def local_agent_pid() -> int:
    """The pid of the host agent that `this_host()` started for this client."""
    from mesh.testing import local_agent

    agent = local_agent()
    assert agent.process.poll() is None
    return agent.pid


@pytest.mark.timeout(60)
def test_a_paused_agent_kills_no_healthy_proc_when_it_resumes(
    watched: Callable[..., Watched],
) -> None:
    """A pause of the supervisor is not a hang of the supervised: heartbeats that queued while
    the agent was stopped count, and the agent's own absence is not held against its procs."""
    w = watched(hb=True)
    agent = local_agent_pid()
    os.kill(agent, signal.SIGSTOP)
    try:
        time.sleep(3 * FAST_HB["heartbeat_timeout_s"])  # the pause itself is the fault
    finally:
        os.kill(agent, signal.SIGCONT)
    assert w.probe.pid.call().get(timeout=T).values() == tuple(w.pids)
    barrier(w.probe)
    assert w.recorder.events == []
    os.kill(w.pids[1], signal.SIGSTOP)  # the agent still watches: a real hang is still one
    (event,) = w.recorder.wait(1)
    assert (event.kind, event.pid) == ("hung", w.pids[1])
    assert w.probe.slice(gpus=0).pid.call_one().get(timeout=T) == w.pids[0]


def test_blocking_sleep_is_not_a_hang(make_procs: Callable[..., Any]) -> None:
    procs = make_procs({"gpus": 1}, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)
    recorder = Recorder()
    procs.on_failure(recorder)
    actors = procs.spawn("sleepy", fa.Fragile)
    assert actors.sleep.call_one(1.5).get(timeout=T) == "slept"  # three heartbeat timeouts
    assert actors.ping.call_one().get(timeout=T) == 0
    assert recorder.events == []


# -- stopping is not a failure -------------------------------------------------------------------


def test_stopped_actor_mesh_refuses_calls_without_an_event(watched: Callable[..., Watched]) -> None:
    w = watched()
    w.actors.stop().get(timeout=T)
    for adverb in ("call", "call_one"):
        with pytest.raises(SupervisionError, match="stopped") as info:
            target = w.actors if adverb == "call" else w.actors.slice(gpus=0)
            getattr(target.ping, adverb)().get(timeout=T)
        assert info.value.event.kind == "stopped"
    assert w.probe.ping.call().get(timeout=T).values() == (0, 1)  # procs untouched
    barrier(w.probe)
    assert w.recorder.events == []


def test_stopping_a_slice_stops_only_those_actors(watched: Callable[..., Watched]) -> None:
    w = watched()
    w.actors.slice(gpus=1).stop().get(timeout=T)
    with pytest.raises(SupervisionError, match="stopped"):
        w.actors.slice(gpus=1).ping.call_one().get(timeout=T)
    assert w.actors.slice(gpus=0).ping.call_one().get(timeout=T) == 0
    barrier(w.probe)
    assert w.recorder.events == []


def test_stopped_proc_mesh_refuses_calls_without_an_event(
    watched: Callable[..., Watched], make_procs: Callable[..., Any]
) -> None:
    w = watched()
    other = make_procs({"gpus": 1}, name="bystander")
    bystander = other.spawn("bystander", fa.Fragile)
    w.procs.stop().get(timeout=T)
    wait_gone(w.pids)
    for future in (w.actors.ping.call(), w.probe.slice(gpus=1).ping.call_one()):
        with pytest.raises(SupervisionError, match="stopped") as info:
            future.get(timeout=T)
        assert info.value.event.kind == "stopped"
    barrier(bystander)
    assert w.recorder.events == []


# -- owner actors and __supervise__ ----------------------------------------------------------


def _owner(
    make_procs: Callable[..., Any],
    tmp_path: Path,
    decision: str = "handle",
    cls: type = fa.SyncOwner,
) -> tuple[Any, Any, Recorder]:
    procs = make_procs({"gpus": 1}, name="top")
    recorder = Recorder()
    procs.on_failure(recorder)
    owner = procs.spawn("owner", cls, str(tmp_path / "record.jsonl"), decision)
    return procs, owner, recorder


@pytest.mark.parametrize(
    "cls", [fa.SyncOwner, fa.AsyncOwner, fa.MonarchStyleOwner], ids=["sync", "async", "cx"]
)
def test_owner_handles_each_failed_rank_once(
    make_procs: Callable[..., Any], tmp_path: Path, cls: type
) -> None:
    _, owner, recorder = _owner(make_procs, tmp_path, "handle", cls)
    owner.spawn_child.call_one("kids", 2).get(timeout=T)
    owner.broadcast_child.call_one("kids", "raise_error", "both ranks").get(timeout=T)
    wait_until(lambda: len(owner.seen_events.call_one().get(timeout=T)) >= 2)
    # Later calls to the failed child raise, but no new event is made.
    result = owner.call_child.call_one("kids", "ping").get(timeout=T)
    assert result[:2] == ("SupervisionError", "exception")
    seen = owner.seen_events.call_one().get(timeout=T)
    assert sorted(dict(e.rank)["gpus"] for e in seen) == [0, 1]
    assert {e.kind for e in seen} == {"exception"} and {e.mesh_name for e in seen} == {"kids"}
    assert all("EndpointError: both ranks" in (e.traceback or "") for e in seen)
    assert recorder.events == []  # handled: nothing reaches the client
    if cls is fa.MonarchStyleOwner:  # Monarch's __supervise__(cx, failure) gets the context
        assert owner.seen_contexts.call_one().get(timeout=T) == ["Context", "Context"]


def test_owner_is_told_when_a_child_constructor_raises(
    make_procs: Callable[..., Any], tmp_path: Path
) -> None:
    _, owner, _ = _owner(make_procs, tmp_path)
    owner.spawn_child.call_one("kids", 2, fa.Fragile, fail_in_init=True, fail_on_rank=0).get(
        timeout=T
    )
    wait_until(lambda: owner.seen_events.call_one().get(timeout=T) != [])
    (event,) = owner.seen_events.call_one().get(timeout=T)
    assert event.kind == "exception" and "constructor" in event.message
    assert dict(event.rank) == {"gpus": 0}


def test_owner_handles_a_child_proc_death(make_procs: Callable[..., Any], tmp_path: Path) -> None:
    _, owner, recorder = _owner(make_procs, tmp_path, "handle", fa.AsyncOwner)
    pids = owner.spawn_child.call_one("kids", 2).get(timeout=T)
    os.kill(pids[0], signal.SIGKILL)
    wait_until(lambda: owner.seen_events.call_one().get(timeout=T) != [])
    (event,) = owner.seen_events.call_one().get(timeout=T)
    assert (event.kind, event.signal, event.pid) == ("signal", "SIGKILL", pids[0])
    # It names the actor mesh the owner spawned, and the actor; the proc id says which proc.
    assert event.mesh_name == "kids" and dict(event.rank or {}) == {"gpus": 0}
    assert event.actor_id is not None and event.actor_id.endswith("[0]")
    assert event.proc_id is not None and event.proc_id.startswith("kids-procs-")
    # The owner lives on; a call to the whole child mesh fails at once (rank 0 is gone),
    # and the other child proc lives on.
    assert owner.call_child.call_one("kids", "ping").get(timeout=T)[0] == "SupervisionError"
    assert pid_alive(pids[1])
    assert owner.pid.call_one().get(timeout=T) > 0
    assert recorder.events == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("cls", "endpoint"),
    [(fa.AsyncOwner, "await_failure"), (fa.SyncOwner, "poll_failure")],
    ids=["async", "sync"],
)
def test_supervise_runs_while_an_endpoint_waits_for_its_decision(
    make_procs: Callable[..., Any], tmp_path: Path, cls: type, endpoint: str
) -> None:
    _, owner, recorder = _owner(make_procs, tmp_path, "handle", cls)
    pids = owner.spawn_child.call_one("kids", 1).get(timeout=T)
    waiting = getattr(owner, endpoint).call_one(15.0)
    wait_until(lambda: (tmp_path / "record.jsonl.busy").exists(), what="the endpoint to start")
    os.kill(pids[0], signal.SIGKILL)
    assert waiting.get(timeout=T) == "seen"  # not "timed out": __supervise__ did not queue
    assert recorder.events == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("cls", "endpoint"), [(fa.AsyncOwner, "ahold"), (fa.SyncOwner, "hold")], ids=["async", "sync"]
)
def test_a_call_in_progress_fails_at_once_when_its_actor_escalates(
    make_procs: Callable[..., Any], tmp_path: Path, cls: type, endpoint: str
) -> None:
    _, owner, recorder = _owner(make_procs, tmp_path, "ignore", cls)
    pids = owner.spawn_child.call_one("kids", 1).get(timeout=T)
    holding = getattr(owner, endpoint).call_one(20.0)
    wait_until(lambda: (tmp_path / "record.jsonl.busy").exists(), what="the endpoint to start")
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(SupervisionError) as info:
        holding.get(timeout=15)  # well before the endpoint itself returns
    assert info.value.event.kind == "escalated"
    assert info.value.event.cause is not None and info.value.event.cause.pid == pids[0]
    assert [event.kind for event in recorder.wait(1)] == ["escalated"]


@pytest.mark.parametrize(
    ("decision", "cls"),
    [
        ("ignore", fa.SyncOwner),
        ("ignore", fa.AsyncOwner),
        ("raise", fa.SyncOwner),
        ("raise", fa.AsyncOwner),
        ("handle", fa.NoHandlerOwner),
    ],
)
def test_owner_that_does_not_handle_fails_and_escalates(
    make_procs: Callable[..., Any], tmp_path: Path, decision: str, cls: type
) -> None:
    _, owner, recorder = _owner(make_procs, tmp_path, decision, cls)
    owner_pid = owner.pid.call_one().get(timeout=T)
    pids = owner.spawn_child.call_one("kids", 2).get(timeout=T)
    os.kill(pids[1], signal.SIGKILL)
    (event,) = recorder.wait(1)
    assert event.kind == "escalated" and event.mesh_name == "owner"
    assert event.pid == owner_pid and dict(event.rank or {}) == {"gpus": 0}
    child = event.cause
    assert child is not None and child.cause is None
    assert (child.kind, child.signal, child.pid) == ("signal", "SIGKILL", pids[1])
    assert child.mesh_name == "kids" and dict(child.rank or {}) == {"gpus": 1}
    assert child.actor_id is not None and child.actor_id.endswith("[1]")
    assert event.root_cause() == child
    assert "owner" in str(event) and str(owner_pid) in str(event)
    if decision == "raise":
        assert "__supervise__ raised RuntimeError" in event.message
        assert "the handler at level 1 gives up" in event.message
        assert "gives up" in (event.traceback or "")
    else:
        assert "'kids'" in event.message
    report = event.report()
    assert (
        report.index("Root cause:") < report.index("SIGKILL") < report.index(f"Process {owner_pid}")
    )
    # The failed owner refuses calls, and the procs it spawned are stopped.
    with pytest.raises(SupervisionError) as info:
        owner.pid.call_one().get(timeout=T)
    assert info.value.event.kind == "escalated"
    wait_gone(pids)
    assert len(recorder.events) == 1


@pytest.mark.parametrize("how", ["actor_mesh", "proc_mesh"])
def test_stopping_an_owner_stops_what_it_spawned(
    make_procs: Callable[..., Any], tmp_path: Path, how: str
) -> None:
    procs, owner, recorder = _owner(make_procs, tmp_path)
    pids = owner.spawn_child.call_one("kids", 2).get(timeout=T)
    if how == "actor_mesh":
        owner.stop().get(timeout=T)
    else:
        procs.stop().get(timeout=T)
    wait_gone(pids)
    assert recorder.events == []
    assert not (tmp_path / "record.jsonl").exists()  # stopping is no failure
