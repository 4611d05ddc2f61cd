"""`get_or_spawn_controller`: one named controller per client, shared by every caller and
thread; a controller whose proc dies fails its callers and is spawned anew on the next ask."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import actors
import pytest
from conftest import meshvisor_processes
from polling import wait_gone, wait_until

import mesh
import mesh.testing
import transport
from mesh import Actor, ActorMesh, endpoint, get_or_spawn_controller
from supervision import SupervisionError

T = 30


@pytest.fixture(autouse=True)
def stopped_controllers() -> Iterator[None]:
    """Every controller a test spawned is stopped after it, pass or fail."""
    yield
    mesh.testing.stop_controllers()


class AsksForAController(Actor):
    """Tries to get a controller from inside an actor (a proc)."""

    @endpoint
    def ask(self) -> str:
        try:
            get_or_spawn_controller("inner", actors.Counter)
        except RuntimeError as error:
            return str(error)
        return "no error"


def test_every_caller_gets_the_same_controller() -> None:
    first = get_or_spawn_controller("counter", actors.Counter, start=10).get(timeout=T)
    assert isinstance(first, ActorMesh) and first.sizes == {} and first.name == "counter"
    again = get_or_spawn_controller("counter", actors.Counter, start=99).get(timeout=T)
    assert again is first  # later arguments are not used
    assert first.incr.call_one().get(timeout=T) == 11
    assert again.incr.call_one().get(timeout=T) == 12
    other = get_or_spawn_controller("other", actors.Counter).get(timeout=T)
    assert other.incr.call_one().get(timeout=T) == 1
    assert other.pid_of.call_one().get(timeout=T) != first.pid_of.call_one().get(timeout=T)
    assert first.pid_of.call_one().get(timeout=T) != os.getpid()  # its own proc


def test_concurrent_callers_share_one_spawn() -> None:
    callers = 8
    mesh.this_host()  # the local agent and its fork server are up before counting processes
    before = {pid for pid, _ in meshvisor_processes()}
    barrier = threading.Barrier(callers)

    def ask(_: int) -> Any:
        barrier.wait(timeout=T)
        controller = get_or_spawn_controller("shared", actors.Counter).get(timeout=T)
        return controller, controller.incr.call_one().get(timeout=T)

    with ThreadPoolExecutor(callers) as pool:
        answers = list(pool.map(ask, range(callers)))
    assert all(controller is answers[0][0] for controller, _ in answers)
    assert sorted(value for _, value in answers) == list(range(1, callers + 1))
    new_processes = {pid for pid, _ in meshvisor_processes()} - before
    assert new_processes == {answers[0][0].pid_of.call_one().get(timeout=T)}  # one spawn


def test_a_controller_whose_proc_dies_fails_its_callers_and_is_spawned_anew(
    root_events: list[Any],
) -> None:
    controller = get_or_spawn_controller("dies", actors.Counter).get(timeout=T)
    assert controller.incr.call_one(5).get(timeout=T) == 5
    pid = controller.pid_of.call_one().get(timeout=T)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: root_events, what="the controller's failure to reach the client")
    [event] = root_events  # the owner (here the client's hook) decides, as for any actor
    assert event.kind == "signal" and event.mesh_name == "dies" and event.pid == pid
    root_events.clear()
    with pytest.raises(SupervisionError, match="dies"):
        controller.incr.call_one().get(timeout=T)
    fresh = get_or_spawn_controller("dies", actors.Counter).get(timeout=T)
    assert fresh is not controller
    assert fresh.incr.call_one().get(timeout=T) == 1  # a new actor, in a new proc
    assert fresh.pid_of.call_one().get(timeout=T) != pid
    assert get_or_spawn_controller("dies", actors.Counter).get(timeout=T) is fresh


def test_a_controller_whose_constructor_fails_is_spawned_anew(root_events: list[Any]) -> None:
    broken = get_or_spawn_controller("broken", actors.BrokenInit).get(timeout=T)
    with pytest.raises(SupervisionError):
        broken.ping.call_one().get(timeout=T)
    wait_until(lambda: root_events, what="the constructor's failure to reach the client")
    root_events.clear()
    assert get_or_spawn_controller("broken", actors.BrokenInit).get(timeout=T) is not broken


def test_a_stopped_controller_is_spawned_anew() -> None:
    controller = get_or_spawn_controller("stopped", actors.Counter).get(timeout=T)
    pid = controller.pid_of.call_one().get(timeout=T)
    controller.stop().get(timeout=T)
    with pytest.raises(SupervisionError, match="stopped"):
        controller.incr.call_one().get(timeout=T)
    fresh = get_or_spawn_controller("stopped", actors.Counter).get(timeout=T)
    assert fresh is not controller and fresh.incr.call_one().get(timeout=T) == 1
    assert fresh.pid_of.call_one().get(timeout=T) != pid
    wait_gone([pid])  # the old controller's proc is stopped, not left behind


def test_arguments_that_do_not_pickle_leave_no_proc_behind() -> None:
    mesh.this_host()
    before = {pid for pid, _ in meshvisor_processes()}
    with pytest.raises(transport.SerializationError, match="cannot pickle"):
        get_or_spawn_controller("unpicklable", actors.Counter, threading.Lock())
    wait_until(lambda: not ({pid for pid, _ in meshvisor_processes()} - before), what="no proc")
    assert get_or_spawn_controller("unpicklable", actors.Counter).get(timeout=T).sizes == {}


def test_bad_requests_are_refused_clearly() -> None:
    get_or_spawn_controller("typed", actors.Counter).get(timeout=T)
    with pytest.raises(TypeError, match="controller 'typed' runs Counter, not Echo"):
        get_or_spawn_controller("typed", actors.Echo)
    with pytest.raises(ValueError, match="controller name 'a/b' contains '/'"):
        get_or_spawn_controller("a/b", actors.Counter)
    with pytest.raises(TypeError, match=r"needs a subclass of mesh\.Actor"):
        get_or_spawn_controller("plain", dict)


def test_inside_an_actor_the_error_says_to_pass_the_handle(make_procs: Any) -> None:
    asker = make_procs({"gpus": 1}).spawn("asker", AsksForAController)
    message = asker.ask.call_one().get(timeout=T)
    assert "works in the client only" in message and "pass its handle" in message
