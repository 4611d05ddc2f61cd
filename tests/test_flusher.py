"""`Flusher`: batches started by a thread that goes on working still leave, from its own thread.

Real ipc sockets: the sender never flushes itself, so every message that arrives was sent by
the flusher's ticks, including after the flusher parked between bursts.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

import transport
from transport import (
    Envelope,
    Flusher,
    Inbox,
    Outbox,
    encode,
    message_type,
    new_context,
    private_runtime_dir,
)

pytestmark = pytest.mark.timeout(60)


@message_type
@dataclass(frozen=True, slots=True)
class Sequenced:
    """A test message: its place in the sender's sequence."""

    seq: int


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.001)


def receive(inbox: Inbox, timeout_s: float = 30.0) -> Envelope:
    deadline = time.monotonic() + timeout_s
    while (envelope := inbox.receive_nowait()) is None:
        remaining = deadline - time.monotonic()
        assert remaining > 0, "a message that waited in a batch was never sent"
        inbox.poll(max(1, int(remaining * 1000)))
    return envelope


def test_batches_leave_on_the_flushers_ticks_in_order_after_it_parked() -> None:
    """Bursts of batched messages arrive whole and in order with no flush by the sender, and
    the flusher parks between bursts (then wakes for the next)."""
    folder = private_runtime_dir("mvt-flusher-")
    context = new_context()
    inbox = Inbox(context, f"ipc://{folder}/in")
    outbox = Outbox(context)
    flusher = Flusher(outbox.flush, 0.001, "mvt-flusher")
    try:
        seq = 0
        for burst in range(3):
            sent = []
            for _ in range(5 + burst * 40):  # one batch, then several (64 per batch)
                if outbox.send_soon(inbox.address, encode(Sequenced(seq))):
                    flusher.soon()
                sent.append(seq)
                seq += 1
            got = [receive(inbox).header.seq for _ in sent]
            assert got == sent
            wait_for(lambda: flusher._parked, "the flusher parking once nothing waits")
        assert inbox.receive_nowait() is None  # nothing sent twice
    finally:
        flusher.stop()
        outbox.close(0)
        inbox.close()
        transport.close_context(context)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_failing_flush_does_not_stop_the_ticks_and_stop_ends_the_thread() -> None:
    calls: list[float] = []

    def flush() -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("a flush that fails once")

    flusher = Flusher(flush, 0.001, "mvt-flusher-failing")
    flusher.soon()
    wait_for(lambda: len(calls) >= 1, "the first flush")
    wait_for(lambda: flusher._parked, "the flusher parking after the failure")
    flusher.soon()
    wait_for(lambda: len(calls) >= 2, "a flush after the failing one")
    (thread,) = [t for t in threading.enumerate() if t.name == "mvt-flusher-failing"]
    flusher.stop()
    thread.join(30)
    assert not thread.is_alive()
    flusher.soon()  # after stop: nothing ticks, no thread starts
    assert not [t for t in threading.enumerate() if t.name == "mvt-flusher-failing"]
