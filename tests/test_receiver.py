"""A proc's receiver: the worker thread that reads the inbox runs sync calls itself
(mesh/_engine/receiver.py). Calls keep their order whichever thread takes them, and a sync
call that blocks never stops its proc from receiving."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import receiver_actors as ra
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh import this_host

T = 60.0


@pytest.fixture(scope="module")
def one_proc() -> Iterator[Any]:
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="receiver")
    try:
        yield procs
    finally:
        procs.stop().get(timeout=T)


@pytest.fixture(scope="module")
def recorder(one_proc: Any) -> Any:
    return one_proc.spawn("recorder", ra.Recorder)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from(["sync", "async", "loop"]), min_size=1, max_size=40))
def test_calls_run_in_the_order_sent_whichever_thread_takes_them(
    one_proc: Any, recorder: Any, steps: list[str]
) -> None:
    """Sync calls (run by the receiver or a worker), async calls (run on the event loop) and
    messages the loop handles (a log level, which sends the calls behind it through the loop
    too) mixed in any order: the actor runs its calls in the order they were sent."""
    futures = []
    for i, step in enumerate(steps):
        if step == "loop":
            futures.append(one_proc.logging_option(False, None, logging.INFO))
        else:
            endpoint = recorder.sync_note if step == "sync" else recorder.async_note
            futures.append(endpoint.call_one(i))
    for future in futures:
        future.get(timeout=T)
    sent = [i for i, step in enumerate(steps) if step != "loop"]
    assert recorder.take.call_one().get(timeout=T) == sent


def test_a_sync_call_that_blocks_leaves_its_proc_receiving(one_proc: Any) -> None:
    """The gate's call blocks the thread that received it until another actor of the same
    proc opens it: that call (and any other) must still be received and run meanwhile."""
    gate = one_proc.spawn("gate", ra.Gate)
    opener = one_proc.spawn("opener", ra.Opener)
    held = gate.hold.call_one(T)
    assert opener.open.call_one().get(timeout=T) == "opened"
    assert held.get(timeout=T) is True
    assert gate.hold.call_one(T).get(timeout=T) is True  # open now: answers at once


def test_each_blocking_sync_call_in_turn_leaves_its_proc_receiving(one_proc: Any) -> None:
    """The watch's alarm is armed anew for every call: the third call that blocks the thread
    that received it is handed over like the first."""
    gate = one_proc.spawn("gate", ra.Gate)
    opener = one_proc.spawn("opener", ra.Opener)
    for _ in range(3):
        held = gate.hold.call_one(T)
        assert opener.open.call_one().get(timeout=T) == "opened"
        assert held.get(timeout=T) is True
        assert opener.close.call_one().get(timeout=T) == "closed"
