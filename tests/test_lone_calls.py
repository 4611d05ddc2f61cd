"""Lone calls (mesh/_engine/lone_calls.py): a call alone in its frame, of a header the proc has
seen before, to an idle actor, runs on the receiving thread without the mailbox's general
path. It must keep every rule of that path: order with whatever arrives meanwhile, the
context of the point it was sent to, errors with their traceback, injected failures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import receiver_actors as ra
from actors import FailsOnLoad
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh import this_host
from mesh.testing import fail_next_call
from supervision import ActorError

T = 60.0


@pytest.fixture(scope="module")
def notes() -> Iterator[Any]:
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="lone")
    try:
        actors = procs.spawn("notes", ra.Notes)
        actors.take.call().get(timeout=T)  # built
        yield actors
    finally:
        procs.stop().get(timeout=T)


def test_round_trips_after_the_first_run_as_lone_calls(notes: Any) -> None:
    one = notes.slice(gpus=0)
    one.note.call_one(-1).get(timeout=T)  # its route is learnt from this one
    before = one.lone_calls.call_one().get(timeout=T)
    assert [one.note.call_one(i).get(timeout=T) for i in range(20)] == list(range(20))
    # (a call may take the general path while the proc's event loop handles a message)
    assert one.lone_calls.call_one().get(timeout=T) - before >= 10
    assert one.take.call_one().get(timeout=T) == [-1, *range(20)]


def test_each_point_a_call_was_sent_to_keeps_its_context(notes: Any) -> None:
    """Calls that differ only in the slice they were sent to have routes of their own."""
    for _ in range(3):
        assert notes.slice(gpus=1).where.call_one().get(timeout=T) == {}
        assert notes.slice(gpus=slice(1, 2)).where.call_one().get(timeout=T) == {"gpus": 0}
        points = notes.where.call().get(timeout=T)
        assert sorted(point["gpus"] for point in points.values()) == [0, 1]


def test_calls_sent_while_a_lone_call_runs_run_after_it(notes: Any) -> None:
    one = notes.slice(gpus=0)
    one.slow_note.call_one(-1, 0.0).get(timeout=T)  # learnt
    one.take.call_one().get(timeout=T)
    slow = one.slow_note.call_one(0, 0.3)
    later = [one.note.call_one(1), one.async_note.call_one(2), one.note.call_one(3)]
    assert [slow.get(timeout=T), *(f.get(timeout=T) for f in later)] == [0, 1, 2, 3]
    assert one.take.call_one().get(timeout=T) == [0, 1, 2, 3]


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from(["wait", "send", "slow", "async"]), min_size=1, max_size=30))
def test_calls_alone_or_queued_run_in_the_order_sent(notes: Any, steps: list[str]) -> None:
    """Round trips (lone calls), calls sent without waiting (queued behind a running one),
    slow ones and async ones, in any mix: the actor runs them in the order they were sent."""
    one = notes.slice(gpus=1)
    futures = []
    for i, step in enumerate(steps):
        if step == "wait":
            assert one.note.call_one(i).get(timeout=T) == i
        elif step == "slow":
            futures.append(one.slow_note.call_one(i, 0.01))
        else:
            endpoint = one.note if step == "send" else one.async_note
            futures.append(endpoint.call_one(i))
    for future in futures:
        future.get(timeout=T)
    assert one.take.call_one().get(timeout=T) == list(range(len(steps)))


def test_a_lone_call_that_raises_carries_its_traceback_and_the_actor_lives(notes: Any) -> None:
    one = notes.slice(gpus=0)
    for attempt in range(3):  # the first learns the route; the others are lone calls
        with pytest.raises(ActorError) as caught:
            one.fail.call_one(f"bad {attempt}").get(timeout=T)
        assert isinstance(caught.value, ValueError)
        assert f"bad {attempt}" in str(caught.value)
        assert "raise ValueError(text)" in caught.value.remote_traceback
    assert one.note.call_one(7).get(timeout=T) == 7
    one.take.call_one().get(timeout=T)


def test_an_injected_failure_applies_to_a_lone_call(notes: Any) -> None:
    one = notes.slice(gpus=0)
    one.note.call_one(0).get(timeout=T)
    one.note.call_one(1).get(timeout=T)
    fail_next_call(one, ValueError("injected"), "note").get(timeout=T)
    with pytest.raises(ActorError, match="injected"):
        one.note.call_one(2).get(timeout=T)
    assert one.note.call_one(3).get(timeout=T) == 3
    assert one.take.call_one().get(timeout=T) == [0, 1, 3]


def test_what_cannot_travel_fails_only_the_lone_call(notes: Any) -> None:
    """A result that cannot be pickled, and arguments that cannot be unpickled in the proc:
    an `ActorError` for that call, each time, and the actor serves the next one."""
    one = notes.slice(gpus=0)
    for _ in range(3):  # the first learns the route; the others are lone calls
        with pytest.raises(ActorError) as result:
            one.make_lock.call_one().get(timeout=T)
        assert isinstance(result.value, TypeError) and "lock" in str(result.value)
        with pytest.raises(ActorError, match="cannot be unpickled"):
            one.note.call_one(FailsOnLoad("in the proc")).get(timeout=T)
        assert one.note.call_one(5).get(timeout=T) == 5
    assert one.take.call_one().get(timeout=T) == [5, 5, 5]
