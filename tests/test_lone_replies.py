"""Lone replies (`transport.LoneInbox.receive_lone`): a reply alone in its frame is read as its
call id, rank and payload body; anything else comes back as `receive_nowait` gives it.

On real ipc sockets: every reply the fast path reads holds what `decode` reads from the same
frame; replies with out-of-band buffers, in batches, other messages and frames that only
look like a reply (truncated, past the size limit) take the general path, and the malformed
ones are dropped, never raised. End to end, calls answered through it keep their order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transport
from mesh.testing import wire
from tests.actors import Counter
from tests.inbox_links import InboxLink
from tests.test_batches import batch_of
from transport import (
    BATCH_MAGIC,
    MAGIC,
    MAX_BATCH_MESSAGES,
    OUT_OF_BAND_MIN_BYTES,
    Envelope,
    LoneInbox,
    Payload,
    encode,
    encode_fields,
    loads,
    lone_shape,
)

pytestmark = pytest.mark.timeout(120)
REPLY = lone_shape(wire.Reply)
LIMIT = 1 << 20  # the inbox's message size limit in these tests


class Link(InboxLink):
    """An outbox and a lone inbox on a real ipc socket, reused by every example."""

    def __init__(self) -> None:
        super().__init__("mvt-lone-", lambda c, a: LoneInbox(c, a, REPLY, max_bytes=LIMIT))

    def receive_once(self, wait_ms: int) -> tuple[Any, ...] | Envelope | None:
        return self.inbox.receive_lone(wait_ms)


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    made = Link()
    try:
        yield made
    finally:
        made.close()


int64 = st.integers(-(1 << 63), (1 << 63) - 1)
small = st.one_of(st.none(), st.integers(), st.text(max_size=50), st.binary(max_size=100))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(int64, int64, small)
def test_a_lone_reply_holds_what_decode_reads(
    link: Link, call_id: int, rank: int, value: Any
) -> None:
    frames = encode_fields(wire.Reply, (call_id, rank), Payload.dump(value))
    link.send(frames)
    got = link.receive()
    assert type(got) is tuple and len(got) == 3
    decoded = transport.decode(frames)
    assert got[:2] == (decoded.header.call_id, decoded.header.rank) == (call_id, rank)
    assert bytes(got[2]) == bytes(decoded.payload.body)  # type: ignore[union-attr]
    assert loads(got[2]) == value


def test_what_is_no_lone_reply_comes_back_as_an_envelope(link: Link) -> None:
    """A reply with out-of-band buffers and other messages are decoded as `receive_nowait`
    decodes them; the replies of a batch are read alone each, in order with the rest."""
    big = bytes(range(256)) * (OUT_OF_BAND_MIN_BYTES // 256 + 1)
    link.send(encode_fields(wire.Reply, (1, 0), Payload.dump(big)))
    link.send(encode(wire.Failure(2, 0, "failed"), Payload.dump("why")))
    link.send(encode(wire.Wake()))
    send_batch(link, (3, 4, 5))
    first = link.receive()
    assert isinstance(first, Envelope) and first.header == wire.Reply(1, 0)
    assert first.payload is not None and first.payload.load() == big
    second = link.receive()
    assert isinstance(second, Envelope) and second.header == wire.Failure(2, 0, "failed")
    assert isinstance(link.receive(), Envelope)  # the Wake
    batch = [link.receive()]
    while (got := link.inbox.received_lone()) is not None:
        batch.append(got)
    assert [type(got) for got in batch] == [Envelope, tuple] * 3
    replies = [got[:2] for got in batch if type(got) is tuple]
    assert replies == [(3, 0), (4, 0), (5, 0)]
    assert [loads(got[2]) for got in batch if type(got) is tuple] == [3, 4, 5]


def test_the_replies_of_a_batch_received_as_envelopes_hold_what_was_sent(link: Link) -> None:
    """`receive_nowait` (and `receive_received`) hand every message over as an envelope,
    those of a batch read alone included."""
    send_batch(link, (6, 7))
    deadline = time.monotonic() + 30
    while (first := link.inbox.receive_nowait(1000)) is None:
        assert time.monotonic() < deadline, "a message sent was never received"
    got = [first, *iter(link.inbox.receive_received, None)]
    assert [type(envelope.header) for envelope in got] == [wire.Wake, wire.Reply] * 2
    assert [envelope.header for envelope in got[1::2]] == [wire.Reply(6, 0), wire.Reply(7, 0)]
    assert [envelope.payload.load() for envelope in got[1::2]] == [6, 7]  # type: ignore[union-attr]


def send_batch(link: Link, call_ids: tuple[int, ...]) -> None:
    """A Wake and a reply per call id, sent to a busy destination: in one batch frame."""
    for call_id in call_ids:
        link.outbox.send_soon(link.inbox.address, encode(wire.Wake()))
        link.outbox.send_soon(
            link.inbox.address, encode_fields(wire.Reply, (call_id, 0), Payload.dump(call_id))
        )
    link.outbox.flush()


def test_a_reply_without_a_payload_comes_with_an_empty_body(link: Link) -> None:
    """(Its call then fails: an empty body cannot be unpickled.)"""
    link.send(encode(wire.Reply(6, 1)))
    got = link.receive()
    assert type(got) is tuple and got[:2] == (6, 1) and bytes(got[2]) == b""


@pytest.mark.parametrize("cut", [1, 8, 16])
def test_a_truncated_reply_is_dropped_not_raised(link: Link, cut: int) -> None:
    frame = encode_fields(wire.Reply, (7, 0), None)[0]
    assert frame.startswith(MAGIC)
    link.send([frame[: len(frame) - cut]])
    link.send(encode_fields(wire.Reply, (8, 0), Payload.dump("after")))
    got = link.receive()  # the truncated one was dropped (logged)
    assert type(got) is tuple and got[:2] == (8, 0) and loads(got[2]) == "after"


def test_a_reply_of_another_wire_version_is_dropped_not_misread(link: Link) -> None:
    frame = bytearray(encode_fields(wire.Reply, (11, 0), Payload.dump("old"))[0])
    frame[len(MAGIC) - 1] += 1  # the version byte
    link.send([bytes(frame)])
    link.send(encode_fields(wire.Reply, (12, 0), Payload.dump("new")))
    got = link.receive()
    assert type(got) is tuple and got[:2] == (12, 0) and loads(got[2]) == "new"


def test_a_reply_past_the_size_limit_is_dropped_not_raised(link: Link) -> None:
    link.send(encode_fields(wire.Reply, (9, 0), Payload.dump("x" * (LIMIT + 1))))  # one frame
    link.send(encode_fields(wire.Reply, (10, 0), Payload.dump(None)))
    got = link.receive()
    assert type(got) is tuple and got[:2] == (10, 0)


#: One message sent: (how it is sent, what it is: a reply whose value is small or needs an
#: out-of-band buffer, or another message).
_SENT = st.tuples(
    st.sampled_from(["send", "send_soon", "flush"]),
    st.sampled_from(["reply", "large reply", "failure", "wake"]),
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(_SENT, max_size=3 * MAX_BATCH_MESSAGES))
@pytest.mark.parametrize("nowait", [False, True], ids=["receive_lone", "receive_lone_nowait"])
def test_every_message_arrives_once_in_order_alone_or_in_batches(
    link: Link, nowait: bool, steps: list[tuple[str, str]]
) -> None:
    """FIFO and exactly once through a lone inbox, whatever mix of direct sends, batched
    sends and flushes: a reply sent in one frame is read alone (its ints and body) whether
    it came alone or in a batch; every other message comes as an envelope. The same read
    without waiting (`receive_lone_nowait`, a host agent's read of its procs' answers)."""
    sent: list[tuple[str, int]] = []
    for how, what in steps:
        if how == "flush":
            link.outbox.flush()
            continue
        seq = len(sent)
        value = bytes([seq % 256]) * (OUT_OF_BAND_MIN_BYTES if what == "large reply" else 8)
        if what == "failure":
            frames = encode(wire.Failure(seq, 0, "failed"), Payload.dump(value))
        elif what == "wake":
            frames = encode(wire.Wake())
        else:
            frames = encode_fields(wire.Reply, (seq, 1), Payload.dump(value))
        (link.outbox.send if how == "send" else link.outbox.send_soon)(link.inbox.address, frames)
        sent.append((what, seq))
    link.outbox.flush()
    for what, seq in sent:
        got = taken_nowait(link) if nowait else link.inbox.received_lone() or link.receive()
        value = bytes([seq % 256]) * (OUT_OF_BAND_MIN_BYTES if what == "large reply" else 8)
        if what == "reply":
            assert type(got) is tuple and got[:2] == (seq, 1) and loads(got[2]) == value
        elif what == "wake":
            assert isinstance(got, Envelope) and got.header == wire.Wake()
        else:
            assert isinstance(got, Envelope) and got.header.call_id == seq
            assert got.payload is not None and got.payload.load() == value
    assert link.inbox.received_lone() is None
    assert link.inbox.receive_lone_nowait() is None, "a message arrived twice"
    assert link.inbox.receive_lone(1) is None, "a message arrived twice"


def taken_nowait(link: Link, timeout_s: float = 30.0) -> tuple[Any, ...] | Envelope:
    """The next message `receive_lone_nowait` hands over, asked again until one is there."""
    deadline = time.monotonic() + timeout_s
    while (got := link.inbox.receive_lone_nowait()) is None:
        assert time.monotonic() < deadline, "a message sent was never received"
        time.sleep(0.001)
    return got


def test_malformed_batches_of_replies_are_dropped_and_good_replies_still_arrive(
    link: Link, capfd: pytest.CaptureFixture[str]
) -> None:
    """A lone inbox splits batches itself: a peer's bad batch costs it that batch (or that
    message), never the receiver, as with any inbox."""
    good = [encode_fields(wire.Reply, (seq, 0), Payload.dump(seq))[0] for seq in range(4)]
    raw = link.context.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(link.inbox.address)
        raw.send(batch_of(good[0], count=1000))  # more messages than its bytes can hold
        raw.send(batch_of(good[0], tail=b"xx"))  # bytes after the last message
        raw.send(batch_of(good[0], good[1])[:-3])  # truncated
        raw.send(BATCH_MAGIC + b"\x01")  # no count
        raw.send(batch_of(good[2], b"garbage, not a message", good[3][:-30], good[3]))
        first = link.receive()
        received = [first, *iter(link.inbox.received_lone, None)]
        assert [got[:2] for got in received] == [(2, 0), (3, 0)]  # type: ignore[index]
        assert link.inbox.receive_lone(1) is None
    finally:
        raw.close(0)
    err = capfd.readouterr().err
    assert err.count("message_dropped") == 6
    assert "more than its size can hold" in err and "bytes after its last message" in err


def test_calls_answered_alone_or_in_batches_keep_their_order(make_procs: Any) -> None:
    """Round trips (replies read alone) and pipelined calls (replies in batches) to one
    actor, interleaved: each answer belongs to its call, in the order the calls were sent."""
    counter = make_procs({"gpus": 1}).spawn("counter", Counter)
    expected = 0
    for _ in range(3):
        for _ in range(20):
            expected += 1
            assert counter.incr.call_one().get(30) == expected
        futures = [counter.incr.call_one() for _ in range(200)]
        assert [future.get(30) for future in futures] == list(range(expected + 1, expected + 201))
        expected += 200
