"""Integration tests of the programming model, with real agents, procs and actors."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import actors
import anyio
import pytest
from polling import pid_alive, wait_until

import mesh.testing
from mesh import (
    ActorMesh,
    Point,
    ProcMesh,
    ValueMesh,
    context,
    current_rank,
    current_size,
    this_host,
    this_proc,
)
from supervision import ActorError, SupervisionError
from transport import SerializationError

T = 30  # seconds: the bound on every wait in this module (never reached when things work)


def gate_name() -> str:
    return f"gate-{uuid.uuid4().hex[:8]}"


# -- adverbs ------------------------------------------------------------------------------------


def test_spawn_returns_at_once_and_call_gathers_a_value_mesh(procs: ProcMesh) -> None:
    echo = procs.spawn("echo", actors.Echo, prefix="p")
    assert isinstance(echo, ActorMesh)
    result = echo.echo.call({"x": [1, 2]}).get(timeout=T)
    assert isinstance(result, ValueMesh)
    assert len(result) == 2
    pairs = list(result)
    assert [dict(point) for point, _ in pairs] == [{"gpus": 0}, {"gpus": 1}]
    assert all(isinstance(point, Point) for point, _ in pairs)
    assert [point.rank for point, _ in pairs] == [0, 1]
    assert result.values() == ({"x": [1, 2]}, {"x": [1, 2]})
    assert result.item(gpus=1) == {"x": [1, 2]}
    kw = echo.echo_kw.call(1, 2, key="v").get(timeout=T)
    assert kw.values() == (("p", (1, 2), {"key": "v"}),) * 2


def test_sync_and_async_endpoints(procs: ProcMesh) -> None:
    echo = procs.spawn("echo", actors.Echo)
    assert echo.aecho.call("a").get(timeout=T).values() == ("a", "a")
    counter = procs.spawn("counter", actors.Counter, 10)
    assert counter.incr.call(2).get(timeout=T).values() == (12, 12)
    assert counter.aincr.call(3).get(timeout=T).values() == (15, 15)
    assert counter.incr.call().get(timeout=T).values() == (16, 16)


def test_call_one_on_a_slice_and_on_a_bigger_mesh(procs: ProcMesh) -> None:
    counter = procs.spawn("counter", actors.Counter)
    assert counter.slice(gpus=1).incr.call_one(5).get(timeout=T) == 5
    assert counter.slice(gpus=slice(0, 1)).incr.call_one(1).get(timeout=T) == 1
    assert counter.get.call().get(timeout=T).values() == (1, 5)
    with pytest.raises(ValueError, match="exactly one actor") as info:
        counter.incr.call_one()  # raises at once, before anything is sent
    assert "2" in str(info.value)
    assert counter.get.call().get(timeout=T).values() == (1, 5)


def test_choose_calls_exactly_one_actor(procs: ProcMesh) -> None:
    counter = procs.spawn("counter", actors.Counter)
    results = [counter.incr.choose().get(timeout=T) for _ in range(20)]
    totals = counter.get.call().get(timeout=T).values()
    assert sum(totals) == 20
    assert sorted(results) == sorted(list(range(1, totals[0] + 1)) + list(range(1, totals[1] + 1)))


def test_stream_yields_results_in_arrival_order(procs: ProcMesh) -> None:
    waiter = procs.spawn("waiter", actors.Waiter)
    gate = procs.spawn("gate", actors.Gate)
    name = gate_name()
    futures = list(waiter.wait_if_rank.stream(name, 0, "v"))
    assert len(futures) == 2
    assert futures[0].get(timeout=T) == (1, "v")  # rank 1 answers first: rank 0 waits
    with pytest.raises(TimeoutError):
        futures[1].get(timeout=0.2)
    gate.slice(gpus=0).open.call_one(name).get(timeout=T)
    assert futures[1].get(timeout=T) == (0, "v")


def test_stream_delivers_errors_as_futures(procs: ProcMesh) -> None:
    raiser = procs.spawn("raiser", actors.Raiser)
    outcomes = []
    for future in raiser.raise_on_rank.stream(0):
        try:
            outcomes.append(("value", future.get(timeout=T)))
        except ValueError as exc:
            assert isinstance(exc, ActorError) and dict(exc.rank) == {"gpus": 0}
            outcomes.append(("error", str(exc.exception)))
    assert sorted(outcomes) == [("error", "rank 0 refuses"), ("value", 1)]


def test_broadcast_is_fire_and_forget_and_ordered_before_later_calls(procs: ProcMesh) -> None:
    counter = procs.spawn("counter", actors.Counter)
    assert counter.incr.broadcast(5) is None
    counter.incr.broadcast(5)
    counter.slice(gpus=1).incr.broadcast(1)
    assert counter.get.call().get(timeout=T).values() == (10, 11)


def test_many_calls_from_several_client_threads(procs: ProcMesh) -> None:
    counter = procs.spawn("counter", actors.Counter)
    echo = procs.spawn("echo", actors.Echo)
    errors: list[BaseException] = []

    def work(tag: int) -> None:
        try:
            for i in range(50):
                assert echo.echo.call((tag, i)).get(timeout=T).values() == ((tag, i),) * 2
                counter.slice(gpus=tag % 2).incr.call_one().get(timeout=T)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(tag,)) for tag in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(T)
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, errors
    assert counter.get.call().get(timeout=T).values() == (100, 100)


def test_future_made_on_one_thread_can_be_awaited_on_another(procs: ProcMesh) -> None:
    echo = procs.spawn("echo", actors.Echo)
    future = echo.slice(gpus=0).echo.call_one("x")  # made on the main thread
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(future.get(timeout=T)))
    thread.start()
    thread.join(T)
    assert box == ["x"]
    assert future.get(timeout=T) == "x"


def test_threads_waiting_on_one_future_all_get_its_value(procs: ProcMesh) -> None:
    """Whichever thread receives the reply, the others waiting on the future wake with it."""
    waiter = procs.spawn("waiter", actors.Waiter)
    gate = procs.spawn("gate", actors.Gate)
    name = gate_name()
    future = waiter.slice(gpus=0).wait.call_one(name, "done")  # made on the main thread
    box: list[Any] = []
    threads = [threading.Thread(target=lambda: box.append(future.get(timeout=T))) for _ in range(3)]
    for thread in threads:
        thread.start()
    gate.slice(gpus=0).open.call_one(name).get(timeout=T)
    assert future.get(timeout=T) == "done"
    for thread in threads:
        thread.join(T)
    assert box == ["done"] * 3


# -- futures ------------------------------------------------------------------------------------


def test_timeout_leaves_the_call_running(procs: ProcMesh) -> None:
    waiter = procs.spawn("waiter", actors.Waiter)
    gate = procs.spawn("gate", actors.Gate)
    name = gate_name()
    future = waiter.slice(gpus=0).wait.call_one(name, "done")
    with pytest.raises(TimeoutError, match="still running"):
        future.get(timeout=0.2)
    assert not future.done()
    with pytest.raises(TimeoutError):
        future.get(timeout=0)
    gate.slice(gpus=0).open.call_one(name).get(timeout=T)
    assert future.get(timeout=T) == "done"
    assert future.done() and future.exception() is None


@pytest.mark.parametrize("timeout", [1e7, math.inf])
def test_a_get_with_a_timeout_of_months_or_infinite_waits_for_the_answer(
    procs: ProcMesh, timeout: float
) -> None:
    """A timeout longer than a socket's receive timeout holds (about 24 days) is no error."""
    echo = procs.spawn("echo", actors.Echo)
    assert echo.slice(gpus=0).echo.call_one("here").get(timeout=timeout) == "here"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_await_futures_from_async_code(procs: ProcMesh, backend: str) -> None:
    echo = procs.spawn("echo", actors.Echo)
    counter = procs.spawn("counter", actors.Counter)

    async def main() -> Any:
        single = await echo.slice(gpus=1).aecho.call_one("one")
        mesh = await echo.echo.call("all")
        results: dict[int, int] = {}

        async def bump(i: int) -> None:
            results[i] = await counter.slice(gpus=i % 2).incr.call_one()

        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(bump, i)
        with pytest.raises(ValueError):
            await (
                procs.spawn("raiser", actors.Raiser)
                .slice(gpus=0)
                .raise_value_error.call_one("async boom")
            )
        streamed = [await future for future in echo.echo.stream("s")]
        return single, mesh.values(), sorted(results.values()), streamed

    single, values, increments, streamed = anyio.run(main, backend=backend)
    assert single == "one"
    assert values == ("all", "all")
    assert increments == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert streamed == ["s", "s"]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_await_a_future_made_in_sync_code(procs: ProcMesh, backend: str) -> None:
    echo = procs.spawn("echo", actors.Echo)
    made_in_sync_code = echo.echo.call("sync")
    one = echo.slice(gpus=0).echo.call_one("one")

    async def main() -> Any:
        return (await made_in_sync_code).values(), await one

    assert anyio.run(main, backend=backend) == (("sync", "sync"), "one")


# -- actor errors -------------------------------------------------------------------------------


def test_actor_error_is_an_instance_of_the_original_type(procs: ProcMesh) -> None:
    raiser = procs.spawn("raiser", actors.Raiser)
    with pytest.raises(ValueError) as info:
        raiser.raise_on_rank.call(1).get(timeout=T)
    error = info.value
    assert isinstance(error, ActorError)
    assert isinstance(error.exception, ValueError)
    assert error.exception.args == ("rank 1 refuses",)
    assert error.mesh_name == "raiser"
    assert dict(error.rank) == {"gpus": 1}
    assert error.endpoint == "raise_on_rank"
    assert error.pid is not None and error.pid != os.getpid()
    assert "in raise_on_rank" in error.remote_traceback  # the frame of the raising endpoint
    assert "ValueError: rank 1 refuses" in error.remote_traceback
    text = str(error)
    assert "raise_on_rank" in text and "raiser" in text and "rank 1 refuses" in text


def test_actor_survives_an_endpoint_error_and_keeps_its_state(procs: ProcMesh) -> None:
    counter = procs.spawn("counter", actors.Counter)
    counter.incr.call(1).get(timeout=T)
    with pytest.raises(actors.CustomError) as info:
        counter.slice(gpus=0).fail_after_incr.call_one().get(timeout=T)
    assert isinstance(info.value, ActorError)
    assert "failed with value 101" in str(info.value)
    assert "fail_after_incr" in info.value.remote_traceback
    assert counter.get.call().get(timeout=T).values() == (101, 1)
    assert counter.incr.call().get(timeout=T).values() == (102, 2)


def test_async_endpoint_errors(procs: ProcMesh) -> None:
    raiser = procs.spawn("raiser", actors.Raiser)
    with pytest.raises(KeyError) as info:
        raiser.slice(gpus=1).araise_key_error.call_one("missing").get(timeout=T)
    assert isinstance(info.value, ActorError)
    assert "araise_key_error" in info.value.remote_traceback
    assert raiser.count.call().get(timeout=T).values() == (0, 1)


def test_choose_propagates_actor_errors(procs: ProcMesh) -> None:
    raiser = procs.spawn("raiser", actors.Raiser)
    with pytest.raises(actors.CustomError, match="chosen"):
        raiser.raise_custom.choose("chosen").get(timeout=T)
    assert sum(raiser.count.call().get(timeout=T).values()) == 1


def test_actor_error_for_an_exception_with_a_two_argument_constructor(procs: ProcMesh) -> None:
    """DESIGN: the ActorError is also an instance of the original type where that type can be
    subclassed. TwoArgError can be subclassed; only its instances do not survive pickling."""
    raiser = procs.spawn("raiser", actors.Raiser)
    with pytest.raises(ActorError) as info:
        raiser.slice(gpus=0).raise_two_arg.call_one(7, "bad input").get(timeout=T)
    error = info.value
    assert "code 7: bad input" in str(error)
    assert "TwoArgError" in str(error)
    assert "raise_two_arg" in error.remote_traceback
    assert raiser.count.call().get(timeout=T).values() == (1, 0)  # the actor survived
    assert isinstance(error, actors.TwoArgError), (
        f"{type(error).__name__} is not a TwoArgError; `except TwoArgError` would miss it"
    )


def test_actor_error_for_an_exception_that_cannot_be_pickled(procs: ProcMesh) -> None:
    raiser = procs.spawn("raiser", actors.Raiser)
    with pytest.raises(ActorError) as info:
        raiser.slice(gpus=0).raise_unpicklable.call_one("holds a lock").get(timeout=T)
    error = info.value
    assert "holds a lock" in str(error) and "FinalError" in str(error)
    assert "raise_unpicklable" in error.remote_traceback
    assert raiser.count.call().get(timeout=T).values() == (1, 0)
    assert isinstance(error, actors.FinalError), (
        f"{type(error).__name__} is not a FinalError; `except FinalError` would miss it"
    )


def test_base_exception_in_an_endpoint_fails_the_actor(procs: ProcMesh) -> None:
    raiser = procs.spawn("raiser", actors.Raiser)
    with pytest.raises(SupervisionError) as info:
        raiser.slice(gpus=0).raise_base.call_one().get(timeout=T)
    assert "FatalSignal" in str(info.value)
    with pytest.raises(SupervisionError):
        raiser.slice(gpus=0).count.call_one().get(timeout=T)
    assert raiser.slice(gpus=1).count.call_one().get(timeout=T) == 0


def test_broadcast_that_raises_fails_the_actor(procs: ProcMesh) -> None:
    raiser = procs.spawn("raiser", actors.Raiser)
    with pytest.raises(SupervisionError) as info:
        raiser.slice(gpus=1).raise_value_error.broadcast("nobody hears this")
        raiser.slice(gpus=1).count.call_one().get(timeout=T)
    assert "nobody hears this" in str(info.value)
    assert raiser.slice(gpus=0).count.call_one().get(timeout=T) == 0


def test_constructor_failure_makes_calls_raise_supervision_error(procs: ProcMesh) -> None:
    # Everything that can surface the failure stays inside the block: fail-fast may raise it
    # in the main thread as soon as the client hears of it.
    with pytest.raises(SupervisionError) as info:
        broken = procs.spawn("broken", actors.BrokenInit, fail_on_rank=0)
        broken.slice(gpus=0).ping.call_one().get(timeout=T)
    assert "constructor refuses to start" in str(info.value)
    assert info.value.event.mesh_name == "broken"
    assert broken.slice(gpus=1).ping.call_one().get(timeout=T) == "pong"


# -- errors at the caller -----------------------------------------------------------------------


def test_unknown_and_non_endpoint_names_raise_attribute_error(procs: ProcMesh) -> None:
    echo = procs.spawn("echo", actors.Echo)
    with pytest.raises(AttributeError, match="no endpoint 'nope'") as info:
        echo.nope  # noqa: B018
    assert "echo" in str(info.value) and "aecho" in str(info.value)  # lists what exists
    with pytest.raises(AttributeError, match="not an endpoint"):
        echo.helper.call()
    with pytest.raises(AttributeError):
        echo._private  # noqa: B018
    assert echo.slice(gpus=0).echo.call_one(3).get(timeout=T) == 3


def test_inherited_and_overridden_endpoints(procs: ProcMesh) -> None:
    child = procs.spawn("child", actors.EchoChild, prefix="c")
    assert child.echo.call(1).get(timeout=T).values() == (("child", 1), ("child", 1))
    assert child.aecho.call(2).get(timeout=T).values() == (2, 2)  # inherited
    assert child.slice(gpus=0).echo_kw.call_one(k=3).get(timeout=T) == ("c", (), {"k": 3})


def test_endpoint_overridden_by_a_plain_method_is_not_an_endpoint(procs: ProcMesh) -> None:
    """`PlainOverride.echo` is a plain method: calling it through a mesh must fail at the caller
    like any non-endpoint method, not silently run the base class's `Echo.echo`."""
    plain = procs.spawn("plain", actors.PlainOverride)
    assert actors.PlainOverride().echo(1) == ("plain override", 1)  # what Python would do
    with pytest.raises(AttributeError, match="not an endpoint"):
        plain.echo.call(1).get(timeout=T)
    assert plain.aecho.call(2).get(timeout=T).values() == (2, 2)


def test_unpicklable_arguments_fail_at_the_caller(procs: ProcMesh) -> None:
    echo = procs.spawn("echo", actors.Echo)
    lock = threading.Lock()
    with pytest.raises(SerializationError) as info:
        echo.echo.call(lock)
    assert isinstance(info.value, TypeError)
    assert "lock" in str(info.value)
    with pytest.raises(TypeError):
        echo.slice(gpus=0).echo.call_one(x for x in range(3))
    with pytest.raises(SerializationError):
        echo.echo.broadcast(lock)
    assert echo.echo.call(1).get(timeout=T).values() == (1, 1)


def test_unpicklable_return_value_becomes_an_actor_error(procs: ProcMesh) -> None:
    actor = procs.spawn("unpicklable", actors.Unpicklable)
    with pytest.raises(ActorError) as info:
        actor.slice(gpus=0).make_lock.call_one().get(timeout=T)
    assert isinstance(info.value, TypeError)  # a SerializationError is a TypeError
    assert "lock" in str(info.value)
    assert actor.ok.call().get(timeout=T).values() == ("still alive", "still alive")


def test_arguments_that_cannot_be_unpickled_remotely_raise_actor_error(procs: ProcMesh) -> None:
    """DESIGN: a payload that cannot be unpickled remotely comes back as an ActorError."""
    echo = procs.spawn("echo", actors.Echo)
    with pytest.raises(ActorError, match="cannot be unpickled") as info:
        echo.slice(gpus=0).echo.call_one(actors.FailsOnLoad("in the actor")).get(timeout=T)
    assert info.value.mesh_name == "echo"
    assert echo.echo.call("fine").get(timeout=T).values() == ("fine", "fine")


def test_result_that_cannot_be_unpickled_by_the_caller_raises_actor_error(procs: ProcMesh) -> None:
    actor = procs.spawn("unpicklable", actors.Unpicklable)
    with pytest.raises(ActorError, match="cannot be unpickled"):
        actor.slice(gpus=1).make_unloadable.call_one().get(timeout=T)
    assert actor.ok.call().get(timeout=T).values() == ("still alive", "still alive")


def test_large_tensors_through_actors(procs: ProcMesh) -> None:
    import torch

    echo = procs.spawn("echo", actors.Echo)
    tensor = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB
    got = echo.slice(gpus=0).echo.call_one(tensor).get(timeout=T)
    assert torch.equal(got, tensor)
    got.mul_(2)  # writable
    params = {"w": torch.nn.Parameter(torch.randn(256, 256)), "b": torch.randn(256, 64).t()}
    back = echo.echo.call(params).get(timeout=T).values()
    for copy in back:
        assert type(copy["w"]) is torch.nn.Parameter
        assert torch.equal(copy["w"].detach(), params["w"].detach())
        assert torch.equal(copy["b"], params["b"])


def test_call_captures_its_arguments_when_it_is_made(make_procs: Any) -> None:
    """A tensor changed right after call() (an optimizer step) must not change what the actor
    receives, even when the call had to wait for the proc to start."""
    import torch

    tensor = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB
    procs = make_procs({"gpus": 1})  # brand new: the call below waits for the proc to start
    echo = procs.spawn("echo", actors.Echo)
    future = echo.echo.call_one(tensor)
    tensor.fill_(-1.0)
    got = future.get(timeout=T)
    assert torch.equal(got, torch.arange(4 << 20, dtype=torch.float32)), (
        "the actor received values written after call() returned"
    )
    future = echo.echo.call_one(tensor)  # and once the proc is running
    tensor.fill_(-2.0)
    assert int((future.get(timeout=T) == -1.0).sum()) == tensor.numel()


def test_spawn_validates_its_arguments(procs: ProcMesh) -> None:
    with pytest.raises(TypeError, match=r"subclass of mesh\.Actor"):
        procs.spawn("bad", object)
    with pytest.raises(ValueError, match="non-empty name"):
        procs.spawn("", actors.Echo)
    with pytest.raises(TypeError, match="env"):
        this_host().spawn_procs(per_host={"gpus": 1}, env={"X": 1})  # type: ignore[dict-item]


# -- context ------------------------------------------------------------------------------------


def test_context_rank_and_size_inside_actors(procs: ProcMesh) -> None:
    who = procs.spawn("who", actors.WhoAmI)
    infos = who.whoami.call().get(timeout=T).values()
    assert [i["rank"] for i in infos] == [{"gpus": 0}, {"gpus": 1}]
    assert [i["flat"] for i in infos] == [0, 1]
    assert all(i["size"] == {"gpus": 2} for i in infos)
    assert all(i["mesh_name"] == "who" for i in infos)
    assert all(i["actor_id"].startswith("who") for i in infos)
    assert all(i["pid"] == i["os_pid"] != os.getpid() for i in infos)
    assert len({i["pid"] for i in infos}) == 2
    assert who.init_info.call().get(timeout=T).values() == (
        {"rank": {"gpus": 0}, "size": {"gpus": 2}},
        {"rank": {"gpus": 1}, "size": {"gpus": 2}},
    )
    asynchronous = who.awhoami.call().get(timeout=T).values()
    assert [a["rank"] for a in asynchronous] == [{"gpus": 0}, {"gpus": 1}]


def test_each_actor_has_its_own_id(procs: ProcMesh) -> None:
    """`context().actor_id` names the actor (its mesh and rank), the same in a call on a
    slice; errors from an actor name that actor too."""
    who = procs.spawn("who", actors.WhoAmI)
    ids = [i["actor_id"] for i in who.whoami.call().get(timeout=T).values()]
    assert ids[0].startswith("who-") and ids[0].endswith("[0]") and ids[1].endswith("[1]")
    assert ids[0][:-3] == ids[1][:-3]  # one mesh
    assert who.slice(gpus=1).whoami.call_one().get(timeout=T)["actor_id"] == ids[1]
    raiser = procs.spawn("raiser", actors.Raiser)
    with pytest.raises(ActorError) as info:
        raiser.slice(gpus=1).raise_value_error.call_one("x").get(timeout=T)
    actor_id = info.value.actor_id
    assert actor_id is not None and actor_id.startswith("raiser-") and actor_id.endswith("[1]")


def test_context_in_the_client() -> None:
    ctx = context()
    assert ctx.actor_id is None
    assert dict(current_rank()) == {}
    assert current_size() == {}
    assert ctx.pid == os.getpid()


def test_renamed_and_flattened_meshes_report_their_coordinates(make_procs: Any) -> None:
    procs = make_procs({"a": 2, "b": 2})
    who = procs.spawn("who", actors.WhoAmI)
    assert who.sizes == {"a": 2, "b": 2} and len(who) == 4
    flat = who.flatten("all")
    assert [i["rank"] for i in flat.whoami.call().get(timeout=T).values()] == [
        {"all": 0},
        {"all": 1},
        {"all": 2},
        {"all": 3},
    ]
    renamed = who.rename(a="x").slice(b=1)
    infos = renamed.whoami.call().get(timeout=T)
    assert [dict(p) for p, _ in infos] == [{"x": 0}, {"x": 1}]
    assert [i["size"] for i in infos.values()] == [{"x": 2}, {"x": 2}]
    pids = [i["pid"] for i in who.whoami.call().get(timeout=T).values()]
    assert [i["pid"] for i in infos.values()] == [pids[1], pids[3]]


# -- environment, output, logging ---------------------------------------------------------------


def test_env_is_passed_to_procs(make_procs: Any) -> None:
    procs = make_procs({"gpus": 1}, env={"MESHVISOR_TEST_VALUE": "hello world"})
    echo = procs.spawn("echo", actors.Echo)
    assert echo.getenv.call_one("MESHVISOR_TEST_VALUE").get(timeout=T) == "hello world"
    other = make_procs({"gpus": 1}).spawn("echo", actors.Echo)
    assert other.getenv.call_one("MESHVISOR_TEST_VALUE").get(timeout=T) is None


def test_env_cannot_give_procs_other_keys_than_their_agent(make_procs: Any) -> None:
    """Procs with other CURVE keys than their agent could never report ready over tcp (their
    agent refuses them), and their spawn and calls waited forever: refused at once instead."""
    with pytest.raises(ValueError, match=r"env cannot set MESHVISOR_CURVE_KEYS.*--keys DIR"):
        make_procs({"gpus": 1}, env={"MESHVISOR_CURVE_KEYS": "/elsewhere"})


def test_procs_get_the_client_sys_path(procs: ProcMesh) -> None:
    path = procs.spawn("echo", actors.Echo).slice(gpus=0).sys_path.call_one().get(timeout=T)
    assert os.path.dirname(actors.__file__) in path


def test_proc_output_is_prefixed_with_mesh_and_point(
    agent_capfd: Callable[[], pytest.CaptureFixture[str]], make_procs: Any
) -> None:
    capfd = agent_capfd()
    procs = make_procs({"gpus": 2})
    printer = procs.spawn("printer", actors.Printer)
    printer.say.call("hello stdout", "hello stderr").get(timeout=T)
    printer.slice(gpus=1).partial.call_one("no newline at the end").get(timeout=T)
    out, err = [], []

    def seen(text: str, stream: list[str]) -> bool:
        captured = capfd.readouterr()
        out.append(captured.out)
        err.append(captured.err)
        return text in "".join(stream)

    for rank in (0, 1):
        wait_until(
            lambda r=rank: seen(f"[procs {{'gpus': {r}}}] hello stdout\n", out),
            what=f"stdout of rank {rank}",
        )
        wait_until(
            lambda r=rank: seen(f"[procs {{'gpus': {r}}}] hello stderr\n", err),
            what=f"stderr of rank {rank}",
        )
    assert "hello stderr" not in "".join(out)
    assert "hello stdout" not in "".join(err)
    procs.stop().get(timeout=T)  # the partial line is flushed when the proc exits
    wait_until(
        lambda: seen("[procs {'gpus': 1}] no newline at the end\n", out),
        what="the unterminated line",
    )


LIFECYCLE_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import actors
    import mesh.testing
    from mesh import this_host

    procs = this_host().spawn_procs(per_host={{"gpus": 1}})
    echo = procs.spawn("echo", actors.Echo)
    print("RESULT", echo.echo.call_one(1).get(timeout=30), flush=True)
    echo.stop().get(timeout=30)
    mesh.testing.shutdown()  # stops the live proc, then the agent
""")

LIFECYCLE_EVENTS = {
    "agent_started",
    "proc_spawned",
    "proc_ready",
    "actor_ready",
    "actor_stopped",
    "proc_exited",
}


def run_client_script(tmp_path: Any, script: str, **env: str) -> subprocess.CompletedProcess:
    path = tmp_path / f"client-{uuid.uuid4().hex[:6]}.py"
    path.write_text(script.format(tests=os.path.dirname(actors.__file__)))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MESHVISOR_")}
    environ.update(env)
    return subprocess.run(
        [sys.executable, str(path)], env=environ, capture_output=True, text=True, timeout=90
    )


def test_lifecycle_events_are_logged_at_info_level(tmp_path: Any) -> None:
    result = run_client_script(
        tmp_path, LIFECYCLE_SCRIPT, MESHVISOR_LOG_LEVEL="info", MESHVISOR_LOG_FORMAT="json"
    )
    assert result.returncode == 0, result.stderr
    assert "RESULT 1" in result.stdout
    events: dict[str, list[dict[str, Any]]] = {}
    for line in result.stderr.splitlines():
        if line.startswith("[procs {'gpus': 0}] "):
            line = line[len("[procs {'gpus': 0}] ") :]
        record = json.loads(line)  # every log line is one JSON object
        events.setdefault(record["event"], []).append(record)
    missing = LIFECYCLE_EVENTS - set(events)
    assert not missing, f"lifecycle events not logged: {missing}\n{result.stderr}"
    for name in LIFECYCLE_EVENTS:
        for record in events[name]:
            assert record["level"] == "info"
            assert "component" in record and "pid" in record and "timestamp" in record
    assert events["actor_ready"][0]["mesh"] == "echo"
    assert events["proc_exited"][0]["exit_code"] == 0
    assert events["proc_exited"][0]["requested"] is True


def test_logs_are_quiet_by_default(tmp_path: Any) -> None:
    result = run_client_script(tmp_path, LIFECYCLE_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert "RESULT 1" in result.stdout
    assert result.stderr == ""


# -- stopping -----------------------------------------------------------------------------------


def test_actor_mesh_stop_makes_later_calls_raise(procs: ProcMesh) -> None:
    counter = procs.spawn("counter", actors.Counter)
    counter.incr.broadcast(1)
    counter.stop().get(timeout=T)
    with pytest.raises(SupervisionError, match="stopped"):
        counter.get.call().get(timeout=T)
    with pytest.raises(SupervisionError, match="stopped"):
        counter.slice(gpus=1).get.call_one().get(timeout=T)
    # The procs are fine: other actors on them still work.
    assert procs.spawn("echo", actors.Echo).echo.call(2).get(timeout=T).values() == (2, 2)


def test_stopping_a_slice_of_an_actor_mesh(procs: ProcMesh) -> None:
    counter = procs.spawn("counter", actors.Counter)
    counter.slice(gpus=0).stop().get(timeout=T)
    with pytest.raises(SupervisionError, match="stopped") as info:
        counter.slice(gpus=0).incr.call_one().get(timeout=T)
    assert info.value.event.kind == "stopped"
    assert counter.slice(gpus=1).incr.call_one().get(timeout=T) == 1


def test_actor_mesh_with_statement_stops(procs: ProcMesh) -> None:
    with procs.spawn("echo", actors.Echo) as echo:
        assert echo.echo.call(1).get(timeout=T).values() == (1, 1)
    with pytest.raises(SupervisionError, match="stopped"):
        echo.echo.call(1).get(timeout=T)


def test_proc_mesh_stop(make_procs: Any) -> None:
    procs = make_procs({"gpus": 2})
    echo = procs.spawn("echo", actors.Echo)
    pids = echo.pid.call().get(timeout=T).values()
    assert procs.stop().get(timeout=T) is None
    assert not any(pid_alive(pid) for pid in pids)  # stop() resolves once they have exited
    with pytest.raises(SupervisionError, match="stopped"):
        echo.echo.call(1).get(timeout=T)
    with pytest.raises(SupervisionError, match="stopped"):
        procs.spawn("late", actors.Echo).echo.call(1).get(timeout=T)
    procs.stop().get(timeout=T)  # stopping twice is harmless


def test_proc_mesh_with_statement_stops(make_procs: Any) -> None:
    with make_procs({"gpus": 1}) as procs:
        echo = procs.spawn("echo", actors.Echo)
        pid = echo.pid.call_one().get(timeout=T)
    assert not pid_alive(pid)
    with pytest.raises(SupervisionError, match="stopped"):
        echo.pid.call_one().get(timeout=T)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_with_stops(make_procs: Any, backend: str) -> None:
    async def main() -> tuple[ActorMesh[Any], int]:
        async with make_procs({"gpus": 1}) as procs:
            async with procs.spawn("echo", actors.Echo) as echo:
                pid = await echo.pid.call_one()
            with pytest.raises(SupervisionError, match="stopped"):
                await echo.pid.call_one()
            other = procs.spawn("other", actors.Echo)
            assert await other.echo.call_one(5) == 5
        return other, pid

    other, pid = anyio.run(main, backend=backend)
    assert not pid_alive(pid)
    with pytest.raises(SupervisionError, match="stopped"):
        other.echo.call_one(1).get(timeout=T)


def test_host_shutdown_stops_the_procs_it_runs() -> None:
    host = this_host()
    procs = host.spawn_procs(per_host={"gpus": 2})
    echo = procs.spawn("echo", actors.Echo)
    pids = echo.pid.call().get(timeout=T).values()
    host.shutdown().get(timeout=T)
    assert not any(pid_alive(pid) for pid in pids)
    with pytest.raises(SupervisionError, match="stopped"):
        echo.echo.call(1).get(timeout=T)
    assert procs.stop().get(timeout=T) is None


def test_shutdown_of_an_idle_agent_is_clean() -> None:
    """HostMesh.shutdown() asks the agent to exit; it must exit by itself (status 0), not be
    SIGKILLed after the grace period because it never noticed the request."""
    host = this_host()
    procs = host.spawn_procs(per_host={"gpus": 1})
    procs.spawn("echo", actors.Echo).echo.call_one(1).get(timeout=T)
    procs.stop().get(timeout=T)
    agent = mesh.testing.local_agent().process
    assert agent.poll() is None
    host.shutdown().get(timeout=T)
    assert agent.returncode == 0, f"the agent was killed (status {agent.returncode})"
    # A new agent starts on demand.
    with this_host().spawn_procs(per_host={"gpus": 1}) as again:
        assert again.spawn("echo", actors.Echo).echo.call_one(2).get(timeout=T) == 2


def test_long_running_endpoints_are_not_mistaken_for_hangs(make_procs: Any) -> None:
    """DESIGN: a proc is hung when it stops answering heartbeats (paused, GIL held); an endpoint
    that sleeps, waits on I/O or runs Python code for longer than the timeout is not."""
    procs = make_procs({"gpus": 1}, heartbeat_interval_s=0.05, heartbeat_timeout_s=0.3)
    sleeper = procs.spawn("sleeper", actors.Sleeper)
    assert sleeper.sleep.call_one(1.0).get(timeout=T) == "slept"
    assert sleeper.spin.call_one(1.0).get(timeout=T) > 0
    assert sleeper.sleep.call_one(0).get(timeout=T) == "slept"


def test_heartbeat_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        this_host().spawn_procs(
            per_host={"gpus": 1}, heartbeat_interval_s=1.0, heartbeat_timeout_s=0.5
        )


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        (
            {"heartbeat_timeout_s": -1.0},
            "heartbeat_timeout_s must be a finite number of seconds > 0",
        ),
        ({"heartbeat_interval_s": -0.1}, "heartbeat_interval_s must be a finite number"),
        ({"heartbeat_timeout_s": 0}, "heartbeat_timeout_s must be a finite number"),
        ({"heartbeat_timeout_s": float("nan")}, "heartbeat_timeout_s must be a finite number"),
        ({"heartbeat_interval_s": float("inf")}, "heartbeat_interval_s must be a finite number"),
        ({"busy_timeout_s": 1.0}, "busy_timeout_s (1) must be at least heartbeat_timeout_s (2)"),
        ({"heartbeat_timeout_s": "2"}, "heartbeat_timeout_s must be a number of seconds"),
    ],
)
def test_bad_heartbeat_settings_are_refused(settings: dict[str, Any], error: str) -> None:
    """A negative timeout would kill every proc at once as hung, nan would turn hang detection
    off: spawn_procs refuses them, naming the setting."""
    with pytest.raises((ValueError, TypeError), match=re.escape(error)):
        this_host().spawn_procs(per_host={"gpus": 1}, **settings)


# -- where actors live --------------------------------------------------------------------------


def test_this_proc_spawns_actors_in_the_client() -> None:
    local = this_proc()
    assert local.sizes == {} and len(local) == 1
    counter = local.spawn("local_counter", actors.Counter, 5)
    who = local.spawn("local_who", actors.WhoAmI)
    try:
        assert counter.incr.call_one().get(timeout=T) == 6
        assert counter.incr.call().get(timeout=T).values() == (7,)
        info = who.whoami.call_one().get(timeout=T)
        assert info["os_pid"] == os.getpid()
        assert info["rank"] == {} and info["size"] == {}

        async def main() -> int:
            return await counter.aincr.call_one(10)

        assert anyio.run(main) == 17
        with pytest.raises(ValueError):
            local.stop()
    finally:
        counter.stop().get(timeout=T)
        who.stop().get(timeout=T)
    with pytest.raises(SupervisionError, match="stopped"):
        counter.incr.call_one().get(timeout=T)


def test_actor_calls_an_actor_it_spawned_in_its_own_proc(procs: ProcMesh) -> None:
    user = procs.spawn("user", actors.LocalUser)
    assert user.bump.call().get(timeout=T).values() == (101, 101)
    assert user.abump.call().get(timeout=T).values() == (102, 102)
    assert user.bump.call().get(timeout=T).values() == (103, 103)
    for pid, local_pid in user.local_pid.call().get(timeout=T).values():
        assert pid == local_pid != os.getpid()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["call_one", "choose"])
def test_sync_endpoint_waits_on_an_async_endpoint_in_its_own_proc(
    procs: ProcMesh, how: str
) -> None:
    user = procs.spawn("user", actors.LocalUser)
    assert user.abump_blocking.call(how).get(timeout=T).values() == (101, 101)
    assert user.bump.call().get(timeout=T).values() == (102, 102)  # sync to sync still works


def test_sync_endpoints_see_no_running_event_loop(procs: ProcMesh) -> None:
    user = procs.spawn("asyncio_user", actors.AsyncioUser)
    assert user.has_running_loop.call().get(timeout=T).values() == (False, False)
    assert user.run_coroutine.call("ran").get(timeout=T).values() == ("ran", "ran")


def test_actor_spawns_and_calls_its_own_procs(make_procs: Any) -> None:
    parent = make_procs({"gpus": 1}).spawn("parent", actors.Parent)
    children = parent.spawn_children.call_one(2).get(timeout=T)
    assert [point for point, _ in children] == [{"kids": 0}, {"kids": 1}]
    child_pids = [pid for _, pid in children]
    assert parent.call_children.call_one().get(timeout=T) == [0, 1]
    assert parent.acall_children.call_one().get(timeout=T) == [0, 1]
    parent.stop_children.call_one().get(timeout=T)
    assert not any(pid_alive(pid) for pid in child_pids)


def test_child_procs_do_not_outlive_their_owner(make_procs: Any) -> None:
    procs = make_procs({"gpus": 1})
    parent = procs.spawn("parent", actors.Parent)
    child_pids = [pid for _, pid in parent.spawn_children.call_one(2).get(timeout=T)]
    assert all(pid_alive(pid) for pid in child_pids)
    procs.stop().get(timeout=T)
    wait_until(lambda: not any(pid_alive(pid) for pid in child_pids), what="children to exit")


def test_mesh_handle_passed_to_another_actor(make_procs: Any) -> None:
    echo = make_procs({"gpus": 2}, name="targets").spawn("echo", actors.Echo)
    assert echo.echo.call(0).get(timeout=T).values() == (0, 0)  # built (see the race test)
    callers = make_procs({"gpus": 1}, name="callers")
    caller = callers.spawn("caller", actors.Caller)
    assert caller.call_echo.call_one(echo, "via handle").get(timeout=T) == ["via handle"] * 2
    assert caller.acall_echo.call_one(echo.slice(gpus=1), 3).get(timeout=T) == [3]
    stored = callers.spawn("stored", actors.Caller, echo)
    assert stored.call_stored.call_one("stored").get(timeout=T) == ["stored", "stored"]
    raiser = make_procs({"gpus": 1}, name="raisers").spawn("raiser", actors.Raiser)
    assert raiser.count.call_one().get(timeout=T) == 0  # built (see the race test below)
    caught = caller.call_raiser.call_one(raiser, "boom").get(timeout=T)
    expected = str(_remote_value_error(raiser, "boom"))  # the same text the client gets
    assert caught.startswith("caught ") and caught.endswith(expected)
    counter = make_procs({"gpus": 1}, name="counters").spawn("counter", actors.Counter)
    assert counter.get.call_one().get(timeout=T) == 0
    assert caller.call_incr.call_one(counter).get(timeout=T) == 1
    assert counter.incr.call_one().get(timeout=T) == 2  # both handles reach the same actor


def test_handle_passed_right_after_spawn_reaches_the_new_actors(make_procs: Any) -> None:
    """spawn() returns at once and calls wait for the actors to be built; that must hold for
    calls made through a handle passed to another actor, too. Here the constructor arguments
    are large, so the client's spawn message is still in flight when the third party's call
    reaches the proc."""
    caller = make_procs({"gpus": 1}, name="callers").spawn("caller", actors.Caller)
    assert caller.ping.call_one().get(timeout=T) == "pong"
    outcomes = []
    for attempt in range(3):  # the race is lost nearly always; three tries make sure of it
        target = make_procs({"gpus": 1}, name="targets").spawn(
            "echo", actors.Echo, prefix="p" * (64 << 20)
        )
        outcomes.append(caller.try_echo.call_one(target, attempt).get(timeout=T))
    assert outcomes == [("ok", [0]), ("ok", [1]), ("ok", [2])], outcomes


def test_supervision_error_inside_an_endpoint_reaches_the_caller(make_procs: Any) -> None:
    """An endpoint that lets a SupervisionError escape (it called a stopped mesh): the caller
    gets an ActorError that is also a SupervisionError, complete with its event."""
    target = make_procs({"gpus": 1}, name="targets").spawn("echo", actors.Echo)
    target.stop().get(timeout=T)
    caller = make_procs({"gpus": 1}, name="callers").spawn("caller", actors.Caller)
    future = caller.call_echo.call_one(target, 1)
    with pytest.raises(ActorError) as info:
        future.get(timeout=T)
    error = info.value
    assert isinstance(error, SupervisionError)
    assert "stopped" in str(error)
    assert error.event.kind == "stopped"
    assert error.event.mesh_name == "echo"
    other = make_procs({"gpus": 1}).spawn("other", actors.Echo)
    assert other.echo.call_one(1).get(timeout=T) == 1  # built before its handle is passed on
    assert caller.call_echo.call_one(other, 2).get(timeout=T) == [2]


def _remote_value_error(raiser: ActorMesh[Any], message: str) -> ActorError:
    try:
        raiser.raise_value_error.call_one(message).get(timeout=T)
    except ActorError as exc:
        return exc
    raise AssertionError("expected an ActorError")


# -- failures -----------------------------------------------------------------------------------


def test_sigkilled_proc_fails_in_flight_calls_at_once(procs: ProcMesh) -> None:
    waiter = procs.spawn("waiter", actors.Waiter)
    victim_pid = waiter.slice(gpus=0).pid.call_one().get(timeout=T)
    in_flight = waiter.slice(gpus=0).wait.call_one(gate_name())
    whole = waiter.wait_if_rank.call(gate_name(), 0)
    start = time.monotonic()
    with pytest.raises(SupervisionError) as info:
        os.kill(victim_pid, signal.SIGKILL)
        in_flight.get(timeout=T)
    elapsed = time.monotonic() - start
    assert elapsed < T / 2, "the failure was not detected at once"
    event = info.value.event
    assert event.kind == "signal" and event.signal == "SIGKILL"
    assert event.pid == victim_pid
    assert dict(event.rank) == {"gpus": 0}
    assert "SIGKILL" in str(info.value) and str(victim_pid) in str(info.value)
    with pytest.raises(SupervisionError):
        whole.get(timeout=T)
    # Health is per rank: the other proc still works, the dead one fails at once.
    assert waiter.slice(gpus=1).ping.call_one().get(timeout=T) == "pong"
    with pytest.raises(SupervisionError, match="SIGKILL"):
        waiter.slice(gpus=0).ping.call_one().get(timeout=T)
    with pytest.raises(SupervisionError):
        waiter.ping.call().get(timeout=T)
    other = procs.spawn("other", actors.Echo)
    assert other.slice(gpus=1).echo.call_one(1).get(timeout=T) == 1


def test_a_graceful_stop_runs_the_procs_exit_handlers(
    make_procs: Callable[..., Any], tmp_path: Any
) -> None:
    procs = make_procs({"gpus": 2})
    witness = procs.spawn("witness", actors.ExitWitness, str(tmp_path))
    pids = list(witness.pid.call().get(timeout=T).values())
    procs.stop().get(timeout=T)
    assert not any(pid_alive(pid) for pid in pids)
    expected = {f"{what}-{pid}" for pid in pids for what in ("atexit", "del")}
    assert {path.name for path in tmp_path.iterdir()} == expected


def test_proc_exiting_unasked_fails_calls(procs: ProcMesh) -> None:
    echo = procs.spawn("echo", actors.Echo)
    with pytest.raises(SupervisionError) as info:
        echo.slice(gpus=1).echo.call_one(_Exit(3)).get(timeout=T)
    assert info.value.event.kind == "exit"
    assert info.value.event.exit_code == 3
    assert "exited with code 3" in str(info.value)
    assert echo.slice(gpus=0).echo.call_one(1).get(timeout=T) == 1


class _Exit:
    """Unpickling this kills the receiving process with the given exit code."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return os._exit, (self.code,)


def test_handle_holder_gets_supervision_error_when_the_target_dies(make_procs: Any) -> None:
    """DESIGN: when a proc is killed, every caller gets SupervisionError at once, including an
    actor that holds a handle to the mesh (not only the mesh's owner)."""
    target = make_procs({"gpus": 1}, name="targets").spawn("waiter", actors.Waiter)
    victim = target.pid.call_one().get(timeout=T)  # also: built before the handle is passed
    caller = make_procs({"gpus": 1}, name="callers").spawn("caller", actors.Caller)
    assert caller.call_with_timeout.call_one(target, T).get(timeout=T) == "pong"
    with pytest.raises(SupervisionError):
        os.kill(victim, signal.SIGKILL)
        target.ping.call_one().get(timeout=T)
    outcome = caller.call_with_timeout.call_one(target, 5.0).get(timeout=T)
    assert outcome == "SupervisionError", f"the handle holder's call ended with {outcome}"


REDIRECTED_STDERR_SCRIPT = textwrap.dedent("""
    import contextlib, io, os, signal, sys, threading
    sys.path.insert(0, {tests!r})
    import actors
    import mesh.testing
    from mesh import this_host

    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):  # meshvisor is first used while this is active
        procs = this_host().spawn_procs(per_host={{"gpus": 1}})
        pid = procs.spawn("waiter", actors.Waiter).pid.call_one().get(timeout=30)
    captured.close()
    handled = threading.Event()
    procs.on_failure(lambda event: handled.set() or True)
    os.kill(pid, signal.SIGKILL)
    print("HANDLED", handled.wait(5), flush=True)
    mesh.testing.shutdown()
""")


def test_supervision_survives_a_closed_stderr(tmp_path: Any) -> None:
    """Logging must never break supervision: meshvisor first used while sys.stderr was
    redirected (a notebook cell, a library capturing output) and a proc dies later. The mesh's
    failure handler must still run."""
    result = run_client_script(tmp_path, REDIRECTED_STDERR_SCRIPT)
    assert "HANDLED True" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0, result.stderr
