"""Keyed calls (`transport.KeyedInbox.receive_keyed`): a call alone in its frame whose header,
after its call id, is a known key is read as (the key's value, call id, payload body);
anything else comes back as `receive_nowait` gives it.

On real ipc sockets: the key of any call's fields is exactly what the encoder writes after the
call id (so routes learnt from decoded calls are found again); calls of unknown keys, with
out-of-band buffers, in batches, and other messages take the general path, in order; frames
that only look like a known call (truncated, another wire version, past the size limit) are
dropped, never raised or misread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transport
from mesh.testing import wire
from tests.inbox_links import InboxLink
from transport import (
    MAGIC,
    OUT_OF_BAND_MIN_BYTES,
    Envelope,
    KeyedInbox,
    Payload,
    encode,
    encode_fields,
    keyed_shape,
    loads,
)

pytestmark = pytest.mark.timeout(120)
CALL = keyed_shape(wire.CallActor)
LIMIT = 1 << 20  # the inbox's message size limit in these tests
REST = ("ipc:///tmp/x/reply", "actor-1", "ping", ("gpus",), (4,), 2)  # a call's fields after its id


class Link(InboxLink):
    """An outbox and a keyed inbox on a real ipc socket, reused by every example."""

    def __init__(self) -> None:
        super().__init__("mvt-keyed-", lambda c, a: KeyedInbox(c, a, max_bytes=LIMIT))
        key = CALL.key(REST)
        assert key is not None
        self.inbox.key_with(CALL, {key: "route"})

    def receive_once(self, wait_ms: int) -> tuple[Any, ...] | Envelope | None:
        return self.inbox.receive_keyed(wait_ms)


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    made = Link()
    try:
        yield made
    finally:
        made.close()


int64 = st.integers(-(1 << 63), (1 << 63) - 1)
names = st.text(max_size=20)
fields = st.tuples(
    st.one_of(st.none(), names),
    names,
    names,
    st.lists(names, max_size=3).map(tuple),
    st.lists(int64, max_size=3).map(tuple),
    int64,
)


@settings(max_examples=200, deadline=None)
@given(int64, fields)
def test_the_key_of_a_call_is_what_its_header_holds_after_the_id(
    call_id: int, rest: tuple[Any, ...]
) -> None:
    """A key is found again in every frame the caller's encoding makes for the same fields,
    and builds the call that `decode` reads."""
    frame = encode_fields(wire.CallActor, (call_id, *rest), Payload.dump(None))[0]
    key = CALL.key(rest)
    if key is None:  # (a lone surrogate: no UTF-8, so no binary header either)
        return
    magic, length, code, first = CALL.unpack_from(frame)
    assert (magic, code, first) == (MAGIC, CALL.code, call_id)
    assert frame[CALL.size : len(MAGIC) + 5 + length] == key
    assert CALL.build(call_id, rest) == transport.decode([frame]).header


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(int64, st.one_of(st.none(), st.integers(), st.text(max_size=50)))
def test_a_keyed_call_holds_what_decode_reads(link: Link, call_id: int, value: Any) -> None:
    frames = encode_fields(wire.CallActor, (call_id, *REST), Payload.dump(value))
    link.send(frames)
    got = link.receive()
    assert type(got) is tuple and got[:2] == ("route", call_id)
    decoded = transport.decode(frames)
    assert decoded.payload is not None and bytes(got[2]) == bytes(decoded.payload.body)
    assert loads(got[2]) == value


def test_what_is_no_keyed_call_comes_back_as_an_envelope(link: Link) -> None:
    """A call of another key, one with out-of-band buffers and other messages are decoded as
    `receive_nowait` decodes them; the calls of a batch come one by one in order, the first
    as an envelope, the others keyed or not, without asking the socket."""
    big = bytes(range(256)) * (OUT_OF_BAND_MIN_BYTES // 256 + 1)
    other = (*REST[:2], "pong", *REST[3:])
    link.send(encode_fields(wire.CallActor, (1, *other), Payload.dump(1)))
    link.send(encode_fields(wire.CallActor, (2, *REST), Payload.dump(big)))
    link.send(encode(wire.Wake()))
    for call_id in (3, 4, 5):  # a busy destination: these wait, then leave in one batch
        fields = (call_id, *(other if call_id == 4 else REST))
        link.outbox.send_soon(
            link.inbox.address, encode_fields(wire.CallActor, fields, Payload.dump(call_id))
        )
    link.outbox.flush()
    first = link.receive()
    assert isinstance(first, Envelope) and first.header == wire.CallActor(1, *other)
    second = link.receive()
    assert isinstance(second, Envelope) and second.header == wire.CallActor(2, *REST)
    assert second.payload is not None and second.payload.load() == big
    assert isinstance(link.receive(), Envelope)  # the Wake
    third = link.receive()  # a batch's first comes as an envelope: the receiver asks for more
    assert isinstance(third, Envelope) and third.header == wire.CallActor(3, *REST)
    fourth = link.inbox.received_keyed()
    assert isinstance(fourth, Envelope) and fourth.header == wire.CallActor(4, *other)
    fifth = link.inbox.received_keyed()
    assert type(fifth) is tuple and fifth[:2] == ("route", 5) and loads(fifth[2]) == 5
    assert link.inbox.received_keyed() is None
    assert link.inbox.receive_keyed(0) is None  # nothing waits: no blocking


@pytest.mark.parametrize("cut", [1, 8, 40])
def test_a_truncated_call_is_dropped_not_raised(link: Link, cut: int) -> None:
    frame = encode_fields(wire.CallActor, (7, *REST), None)[0]
    link.send([frame[: len(frame) - cut]])
    link.send(encode_fields(wire.CallActor, (8, *REST), Payload.dump("after")))
    got = link.receive()  # the truncated one was dropped (logged)
    assert type(got) is tuple and got[1] == 8 and loads(got[2]) == "after"


def test_a_call_of_another_wire_version_is_dropped_not_misread(link: Link) -> None:
    frame = bytearray(encode_fields(wire.CallActor, (11, *REST), Payload.dump("old"))[0])
    frame[len(MAGIC) - 1] += 1  # the version byte
    link.send([bytes(frame)])
    link.send(encode_fields(wire.CallActor, (12, *REST), Payload.dump("new")))
    got = link.receive()
    assert type(got) is tuple and got[1] == 12 and loads(got[2]) == "new"


def test_a_call_past_the_size_limit_is_dropped_not_raised(link: Link) -> None:
    link.send(encode_fields(wire.CallActor, (9, *REST), Payload.dump("x" * (LIMIT + 1))))
    link.send(encode_fields(wire.CallActor, (10, *REST), Payload.dump(None)))
    got = link.receive()
    assert type(got) is tuple and got[1] == 10
