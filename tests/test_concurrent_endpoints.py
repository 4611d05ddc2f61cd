"""Concurrent endpoints: calls that overlap the actor's other messages, within a bound."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lifecycle_actors as la
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh import Actor, ProcMesh, concurrent_endpoint, endpoint, this_host
from supervision import ActorError, SupervisionError

T = 60.0


def test_sync_concurrent_calls_overlap(procs: ProcMesh) -> None:
    actors = procs.spawn("overlap", la.Overlapping)
    futures = [actors.meet.call("sync", 3) for _ in range(3)]  # each waits for the other two
    answers = [future.get(timeout=T).values() for future in futures]
    for rank in (0, 1):  # the barrier of each proc let its three calls through together
        assert sorted(answer[rank] for answer in answers) == [0, 1, 2]


def test_async_concurrent_calls_overlap(procs: ProcMesh) -> None:
    actors = procs.spawn("aoverlap", la.Overlapping)
    first = actors.ameet.call("a", "b")  # waits for the second call, which comes after it
    second = actors.ameet.call("b", "a")
    assert list(first.get(timeout=T).values()) == ["a", "a"]
    assert list(second.get(timeout=T).values()) == ["b", "b"]


def test_a_concurrent_call_overlaps_the_ordinary_call_behind_it(procs: ProcMesh) -> None:
    actors = procs.spawn("mixed", la.Overlapping).slice(gpus=0)
    waiting = actors.ajoin.call_one("knock")  # ends only after the next call ran
    assert actors.append.call_one(7).get(timeout=T) == 7
    assert actors.aknock.call_one("knock").get(timeout=T) == "knock"
    assert waiting.get(timeout=T) == "knock"


@pytest.fixture(scope="module")
def shared() -> Iterator[Any]:
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="ordering")
    try:
        yield procs
    finally:
        procs.stop().get(timeout=T)


KINDS = st.sampled_from(["ordinary", "concurrent", "aconcurrent"])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kinds=st.lists(KINDS, min_size=1, max_size=30))
def test_ordinary_calls_keep_their_order_among_concurrent_ones(
    shared: Any, kinds: list[str]
) -> None:
    actor = shared.spawn("order", la.Overlapping)
    futures = []
    for value, kind in enumerate(kinds):
        if kind == "ordinary":
            futures.append(actor.append.call_one(value))
        elif kind == "concurrent":
            futures.append(actor.concurrent_echo.call_one(value))
        else:
            futures.append(actor.aconcurrent_echo.call_one(value))
    assert [f.get(timeout=T) for f in futures] == list(range(len(kinds)))
    ordinary = [value for value, kind in enumerate(kinds) if kind == "ordinary"]
    assert actor.appended.call_one().get(timeout=T) == ordinary
    actor.stop().get(timeout=T)


def test_the_bound_holds_and_later_calls_wait_in_order(make_procs: Any) -> None:
    procs = make_procs({"gpus": 1})
    bounded = procs.spawn("bounded", la.Bounded)
    tally = procs.spawn("tally", la.Tally)
    holds = [bounded.hold.call_one(i) for i in range(5)]
    peak = bounded.peak.call_one()  # an ordinary call waits behind the parked ones
    assert tally.wait_active.call_one(2).get(timeout=T) == 2
    assert not peak.done()
    tally.release.call_one().get(timeout=T)
    assert [f.get(timeout=T) for f in holds] == list(range(5))
    assert peak.get(timeout=T) == 2


def test_a_concurrent_endpoint_that_raises_fails_only_the_call(procs: ProcMesh) -> None:
    actors = procs.spawn("raising", la.Overlapping)
    with pytest.raises(ActorError) as info:
        actors.raise_value_error.call("boom").get(timeout=T)
    assert info.value.exception_type == "ValueError"
    assert "boom" in str(info.value)
    assert list(actors.append.call(1).get(timeout=T).values()) == [1, 1]


def test_a_fatal_error_in_a_concurrent_endpoint_fails_the_actor(procs: ProcMesh) -> None:
    actors = procs.spawn("fatal", la.Overlapping)
    with pytest.raises(SupervisionError) as info:
        actors.slice(gpus=1).araise_base.call_one().get(timeout=T)
    assert dict(info.value.event.rank or {}) == {"gpus": 1}
    assert "KeyboardInterrupt" in str(info.value)
    with pytest.raises(SupervisionError):
        actors.slice(gpus=1).append.call_one(1).get(timeout=T)
    assert actors.slice(gpus=0).append.call_one(2).get(timeout=T) == 2


def test_mesh_wide_and_sliced_calls_of_concurrent_endpoints(make_procs: Any) -> None:
    actors = make_procs({"x": 2, "y": 2}).spawn("wide", la.Overlapping)
    assert list(actors.where.call().get(timeout=T).values()) == [0, 1, 2, 3]
    assert list(actors.slice(x=1).where.call().get(timeout=T).values()) == [0, 1]
    streamed = sorted(f.get(timeout=T) for f in actors.concurrent_echo.stream(5))
    assert streamed == [5, 5, 5, 5]
    actors.aconcurrent_echo.broadcast(1)
    assert list(actors.append.call(3).get(timeout=T).values()) == [3, 3, 3, 3]


def test_stop_waits_for_the_concurrent_calls_in_progress(procs: ProcMesh) -> None:
    actors = procs.spawn("stopping", la.Overlapping)
    waiting = actors.ajoin.call("late")
    stopped = actors.stop()
    knocker = procs.spawn("knocker", la.Overlapping)
    assert not stopped.done()
    knocker.aknock.call("late").get(timeout=T)  # same procs, so the same per-proc events
    assert list(waiting.get(timeout=T).values()) == ["late", "late"]
    stopped.get(timeout=T)


def test_bad_bounds_and_decorator_misuse_are_refused_at_class_definition() -> None:
    with pytest.raises(TypeError, match="max_concurrent_calls = 0"):

        class Zero(Actor):
            max_concurrent_calls = 0

    with pytest.raises(TypeError, match="replaces @endpoint"):

        class Both(Actor):
            @concurrent_endpoint
            @endpoint
            def f(self) -> None: ...

    class Fine(Actor):
        max_concurrent_calls = 3

        @concurrent_endpoint()
        async def f(self) -> None: ...

    assert Fine.f.concurrent and not la.Overlapping.append.concurrent
