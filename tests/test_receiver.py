"""A proc's receiver: the worker thread that reads the inbox runs sync calls itself
(mesh/_engine/receiver.py). Calls keep their order whichever thread takes them, and a sync
call that blocks never stops its proc from receiving."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import receiver_actors as ra
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh import Channel, this_host

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


def test_a_sync_call_that_blocks_is_handed_over_once(one_proc: Any) -> None:
    """The watch gives the inbox to another thread when the call on the receiving thread
    sleeps (here on an event): once for that call. The call says when it runs; the thread
    running it then reads the inbox no more, so the call that opens the gate, sent after,
    can only be received after a hand-over."""
    gate, opener = one_proc.spawn("gate", ra.Gate), one_proc.spawn("opener", ra.Opener)
    echo = one_proc.spawn("echo", ra.Echo)
    before = echo.hand_overs.call_one().get(timeout=T)
    port, started = Channel[str].open()
    held = gate.hold_telling.call_one(port, T)
    assert started.recv().get(timeout=T) == "holding"
    assert opener.open.call_one().get(timeout=T) == "opened"
    assert held.get(timeout=T) is True
    assert opener.close.call_one().get(timeout=T) == "closed"
    # once; or never, when the call went the loop's way (messages handed to the loop were still
    # being dispatched as it came: order kept) and ran beside the receiving thread, not on it
    assert echo.hand_overs.call_one().get(timeout=T) - before in (0, 1)


@pytest.mark.parametrize("way", ["spin", "nap"])
def test_a_sync_call_that_computes_or_naps_long_is_handed_over(one_proc: Any, way: str) -> None:
    """A call busy on the CPU with no call ending (it never sleeps), or one napping 1 ms at a
    time (never asleep for long), still hands the inbox over, once: the call that ends its
    loop is received and run meanwhile."""
    spinner, opener = one_proc.spawn("spinner", ra.Spinner), one_proc.spawn("opener", ra.Opener)
    echo = one_proc.spawn("echo", ra.Echo)
    before = echo.hand_overs.call_one().get(timeout=T)
    port, started = Channel[str].open()
    spinning = getattr(spinner, way).call_one(port, T)
    assert started.recv().get(timeout=T) in ("spinning", "napping")
    assert opener.open.call_one().get(timeout=T) == "opened"
    assert spinning.get(timeout=T) is True
    assert opener.close.call_one().get(timeout=T) == "closed"
    # once; or never, when the call went the loop's way (messages handed to the loop were still
    # being dispatched as it came: order kept) and ran beside the receiving thread, not on it
    assert echo.hand_overs.call_one().get(timeout=T) - before in (0, 1)


def test_a_napping_call_is_handed_over_while_other_threads_end_calls(one_proc: Any) -> None:
    """The receiving thread naps (1 ms at a time) while another worker thread ends a call
    every 2 ms: the watch counts the holder's own calls ended, not the proc's, so it hands
    the inbox over long before the ticks run out (they would take 8 s or more)."""
    spinner, ticker = one_proc.spawn("spinner", ra.Spinner), one_proc.spawn("ticker", ra.Ticker)
    opener, echo = one_proc.spawn("opener", ra.Opener), one_proc.spawn("echo", ra.Echo)
    before = echo.hand_overs.call_one().get(timeout=T)
    waiting = ticker.wait_for_nap.call_one(T)  # blocks its thread: handed over
    ticks = [ticker.tick.call_one() for _ in range(4000)]  # queued behind it
    port, started = Channel[str].open()
    napping = spinner.nap_while_ticking.call_one(port, T)  # run by the receiving thread
    assert started.recv().get(timeout=T) == "napping"
    assert opener.open.call_one().get(timeout=T) == "opened"
    assert napping.get(timeout=T) < len(ticks)
    assert waiting.get(timeout=T) is True
    for tick in ticks:
        tick.get(timeout=T)
    assert opener.close.call_one().get(timeout=T) == "closed"
    assert echo.hand_overs.call_one().get(timeout=T) == before + 2


def test_a_drain_of_many_short_calls_keeps_the_inbox(one_proc: Any) -> None:
    """Pipelined calls of 0.1 ms each: the receiving thread runs them in passes of up to 256
    that last well over the watch's 5 ms, but it progresses, so it never hands the inbox over
    (two threads would then take turns on the GIL, one receiving and one running)."""
    echo = one_proc.spawn("echo", ra.Echo)
    before = echo.hand_overs.call_one().get(timeout=T)
    futures = [echo.busy.call_one(i, 0.0001) for i in range(1500)]
    assert [future.get(timeout=T) for future in futures] == list(range(1500))
    assert echo.hand_overs.call_one().get(timeout=T) == before


def test_calls_that_come_sparsely_do_not_wake_the_idle_proc(one_proc: Any) -> None:
    """Calls far apart (as calls to a whole mesh, one after the other): the receiver disarms
    its watch's alarm before waiting again, so that it does not go off in the idle proc after
    each call. (Without that, each of these calls is followed by a wake-up 5 ms later; one
    may still come where the receiving thread was preempted 5 ms between a call's end and
    its next wait, on a loaded machine, hence the bound rather than zero.)"""
    echo = one_proc.spawn("echo", ra.Echo)
    calls = 20
    before = echo.idle_alarms.call_one().get(timeout=T)
    for i in range(calls):
        time.sleep(0.01)  # more than the alarm's 5 ms: it would go off before the next call
        assert echo.ping.call_one(i).get(timeout=T) == i
    time.sleep(0.01)
    assert echo.idle_alarms.call_one().get(timeout=T) - before <= calls // 2


def test_a_blocking_call_after_sparse_ones_is_still_handed_over(one_proc: Any) -> None:
    """The alarm, disarmed while the proc is idle, is armed again by the next call: a call
    that blocks the receiving thread after sparse ones still leaves its proc receiving."""
    gate, opener = one_proc.spawn("gate", ra.Gate), one_proc.spawn("opener", ra.Opener)
    for _ in range(3):
        time.sleep(0.01)
        held = gate.hold.call_one(T)
        assert opener.open.call_one().get(timeout=T) == "opened"
        assert held.get(timeout=T) is True
        assert opener.close.call_one().get(timeout=T) == "closed"
