"""Batches: several small messages in one frame keep per-destination FIFO and at-most-once.

Transport level: an `Outbox` sending to real ipc inboxes through every path (`send`,
`send_soon`, `flush`, large messages that never batch); malformed batches from a raw peer.
Engine level: pipelined calls to a real proc, whose calls and replies travel in batches.
"""

from __future__ import annotations

import os
import shutil
import signal
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transport
from supervision import SupervisionError
from tests.actors import Counter
from transport import (
    BATCH_MAGIC,
    MAX_BATCH_MESSAGES,
    OUT_OF_BAND_MIN_BYTES,
    Envelope,
    Inbox,
    Outbox,
    Payload,
    encode,
    message_type,
    new_context,
    private_runtime_dir,
)

pytestmark = pytest.mark.timeout(120)


@message_type
@dataclass(frozen=True, slots=True)
class Numbered:
    """A test message: its destination and its place in the sender's sequence."""

    run: int
    destination: int
    seq: int


class Link:
    """One outbox and two inboxes on real ipc sockets, reused by every example."""

    def __init__(self) -> None:
        self.folder = private_runtime_dir("mvt-batches-")
        self.context = new_context()
        self.inboxes = [Inbox(self.context, f"ipc://{self.folder}/in{i}") for i in range(2)]
        self.outbox = Outbox(self.context)
        self.runs = 0

    def receive(self, inbox: Inbox, timeout_s: float = 30.0) -> Envelope:
        deadline = time.monotonic() + timeout_s
        while (envelope := inbox.receive_nowait()) is None:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "a message sent was never received"
            inbox.poll(max(1, int(remaining * 1000)))
        return envelope

    def close(self) -> None:
        self.outbox.close(0)
        for inbox in self.inboxes:
            inbox.close()
        transport.close_context(self.context)
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    made = Link()
    try:
        yield made
    finally:
        made.close()


#: One step of a sender: (how it sends, to which inbox, whether the payload is large).
step = st.tuples(st.sampled_from(["send", "send_soon", "flush"]), st.integers(0, 1), st.booleans())


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(step, max_size=3 * MAX_BATCH_MESSAGES))
def test_every_message_arrives_once_in_order_per_destination(
    link: Link, steps: list[tuple[str, int, bool]]
) -> None:
    """FIFO per destination and at-most-once (here: exactly once, the link is healthy),
    whatever mix of direct sends, batched sends, flushes and large messages came before."""
    link.runs += 1
    run, sent = link.runs, [[], []]
    for how, destination, large in steps:
        if how == "flush":
            link.outbox.flush()
            continue
        seq = len(sent[destination])
        value = bytes([seq % 256]) * (OUT_OF_BAND_MIN_BYTES if large else 8)
        frames = encode(Numbered(run, destination, seq), Payload.dump(value))
        send = link.outbox.send if how == "send" else link.outbox.send_soon
        send(link.inboxes[destination].address, frames)
        sent[destination].append(value)
    link.outbox.flush()
    for destination, inbox in enumerate(link.inboxes):
        for seq, value in enumerate(sent[destination]):
            envelope = link.receive(inbox)
            assert envelope.header == Numbered(run, destination, seq)
            assert envelope.payload is not None and envelope.payload.load() == value
        assert inbox.receive_nowait() is None, "a message arrived twice"


def batch_of(*messages: bytes, count: int | None = None, tail: bytes = b"") -> bytes:
    """A batch frame framed by hand (as `transport._batches` documents its layout)."""
    parts = [BATCH_MAGIC, struct.pack("<I", len(messages) if count is None else count)]
    for message in messages:
        parts += [struct.pack("<I", len(message)), message]
    return b"".join(parts) + tail


def test_malformed_batches_are_dropped_and_good_messages_still_arrive(
    link: Link, capfd: pytest.CaptureFixture[str]
) -> None:
    """A peer's bad batch costs it that batch (or that message), never the receiver."""
    good = [encode(Numbered(-1, 0, seq))[0] for seq in range(4)]
    raw = link.context.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    inbox = link.inboxes[0]
    try:
        raw.connect(inbox.address)
        raw.send(batch_of(good[0], count=1000))  # more messages than its bytes can hold
        raw.send(batch_of(good[0], tail=b"xx"))  # bytes after the last message
        raw.send(batch_of(good[0], good[1])[:-3])  # truncated
        raw.send(BATCH_MAGIC + b"\x01")  # no count
        raw.send(batch_of(good[2], b"garbage, not a message", good[3]))  # one bad message
        received = [link.receive(inbox).header.seq for _ in range(2)]
        assert received == [2, 3]
        assert inbox.receive_nowait() is None
    finally:
        raw.close(0)
    err = capfd.readouterr().err
    assert err.count("message_dropped") == 5
    assert "more than its size can hold" in err and "bytes after its last message" in err


def test_pipelined_calls_batch_and_keep_order_and_run_once(
    make_procs: Any, root_events: list[Any]
) -> None:
    """Calls to a busy proc and their replies travel in batches: each call still runs once,
    in the order sent (sync and async endpoints mixed, broadcasts between them), and each
    future gets its own answer. A SIGKILL with batches in flight fails the unanswered calls;
    no answered call was applied twice or out of order."""
    counter = make_procs({"procs": 1}).spawn("counter", Counter)
    counter.get.call_one().get(timeout=60)
    expected, futures, total = [], [], 0
    for i in range(400):
        if i % 9 == 4:
            counter.incr.broadcast(1000)
            total += 1000
            continue
        total += 1
        endpoint = counter.aincr if i % 5 == 0 else counter.incr
        futures.append(endpoint.call_one(1))
        expected.append(total)
    assert [f.get(timeout=60) for f in futures] == expected
    assert counter.get.call_one().get(timeout=60) == total

    pid = counter.pid_of.call_one().get(timeout=60)
    futures = [counter.incr.call_one(1) for _ in range(300)]
    os.kill(pid, signal.SIGKILL)
    for index, future in enumerate(futures):  # each ends: its own answer, or the death
        try:
            value = future.get(timeout=60)
        except SupervisionError as exc:
            assert exc.event.pid == pid and exc.event.signal == "SIGKILL"
            continue
        assert value == total + index + 1, "a call ran twice, or out of order"
    deadline = time.monotonic() + 60
    while not root_events and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [event.signal for event in root_events] == ["SIGKILL"]
    root_events.clear()
