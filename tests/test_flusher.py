"""`Flusher`: batches started by a thread that goes on working still leave, from its own thread.

Real ipc sockets: the sender never flushes itself, so every message that arrives was sent by
the flusher's ticks, including after the flusher parked between bursts.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transport
from transport import (
    OUT_OF_BAND_MIN_BYTES,
    Envelope,
    Flusher,
    Inbox,
    Outbox,
    Payload,
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


@message_type
@dataclass(frozen=True, slots=True)
class Addressed:
    """A test message: its run, its destination and its place in that destination's sequence."""

    run: int
    destination: int
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


class Senders:
    """One outbox with its flusher and two inboxes on real ipc sockets, reused by every example."""

    def __init__(self) -> None:
        self.folder = private_runtime_dir("mvt-flusher-")
        self.context = new_context()
        self.inboxes = [Inbox(self.context, f"ipc://{self.folder}/in{i}") for i in range(2)]
        self.outbox = Outbox(self.context)
        self.flusher = Flusher(self.outbox.flush, 0.001, "mvt-flusher-property")
        self.runs = 0

    def close(self) -> None:
        self.flusher.stop()
        self.outbox.close(0)
        for inbox in self.inboxes:
            inbox.close()
        transport.close_context(self.context)
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def senders() -> Iterator[Senders]:
    made = Senders()
    try:
        yield made
    finally:
        made.close()


#: One message of a sender thread: (to which inbox, whether it may wait in a batch, large).
message = st.tuples(st.integers(0, 1), st.booleans(), st.booleans())


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.lists(message, max_size=150), min_size=1, max_size=3))
def test_fifo_per_sender_and_destination_while_the_flusher_sends_concurrently(
    senders: Senders, threads: list[list[tuple[int, bool, bool]]]
) -> None:
    """Several threads send through one outbox (direct sends, batched ones, large messages
    that never batch) while the flusher's ticks send batches from its own thread: every
    message arrives once, and each thread's messages to one destination in the order sent."""
    senders.runs += 1
    run = senders.runs

    def send_all(sender: int, messages: list[tuple[int, bool, bool]]) -> None:
        for seq, (destination, batched, large) in enumerate(messages):
            size = OUT_OF_BAND_MIN_BYTES if large else 8
            frames = encode(
                Addressed(run, destination, sender * 1000 + seq), Payload.dump(b"x" * size)
            )
            address = senders.inboxes[destination].address
            if not batched:
                senders.outbox.send(address, frames)
            elif senders.outbox.send_soon(address, frames):
                senders.flusher.soon()

    workers = [threading.Thread(target=send_all, args=(i, m)) for i, m in enumerate(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    for destination, inbox in enumerate(senders.inboxes):
        expected = sum(1 for messages in threads for d, _, _ in messages if d == destination)
        got = [receive(inbox).header for _ in range(expected)]  # no flush here: the flusher's
        assert all(h.run == run and h.destination == destination for h in got)
        for sender in range(len(threads)):
            mine = [h.seq for h in got if h.seq // 1000 == sender]
            assert mine == sorted(mine), f"sender {sender}'s messages arrived out of order"
        assert len({h.seq for h in got}) == expected, "a message arrived twice"
        assert inbox.receive_nowait() is None, "a message arrived twice"
