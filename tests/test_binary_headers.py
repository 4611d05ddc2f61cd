"""Binary headers (`transport.binary_header`): the struct-packed headers of calls and replies.

Every value of the declared field types comes back as it was sent; every truncated or
corrupted binary header is refused with MalformedMessage (never another exception), and a
proc sent one keeps serving.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any

import actors
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_agent_hardening import T, ping, raw_peer

from mesh.testing import wire
from transport import (
    MAGIC,
    MalformedMessage,
    MessageTooLarge,
    Payload,
    binary_header,
    decode,
    dump_arguments,
    encode,
    encode_fields,
    encode_prepared,
    encode_prepared_arguments,
    encode_prepared_last,
    encode_prepared_value,
    message_type,
    prepare_header,
    prepare_header_but_last,
    transport_settings,
    use_transport_settings,
)


@binary_header(b"T")
@message_type
@dataclass(frozen=True, slots=True)
class Every:
    """A header with a field of every kind a binary header holds."""

    number: int
    name: str
    maybe: str | None
    names: tuple[str, ...]
    last: int
    numbers: tuple[int, ...]


@binary_header(b"L")
@message_type
@dataclass(frozen=True, slots=True)
class Leading:
    """A header that leads with several ints (packed afresh each time), then what is kept."""

    number: int
    second: int
    third: int
    name: str
    last: int
    numbers: tuple[int, ...]


INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)  # UTF-8 encodable
EVERY = st.builds(
    Every,
    INT64,
    TEXT,
    st.none() | TEXT,
    st.lists(TEXT, max_size=4).map(tuple),
    INT64,
    st.lists(INT64, max_size=4).map(tuple),
)


def codec(frames: list[Any]) -> bytes:
    """The codec byte of an encoded message (after the magic and the header length)."""
    first = bytes(frames[0])
    return first[len(MAGIC) + 4 : len(MAGIC) + 5]


@settings(max_examples=300, deadline=None, database=None)
@given(EVERY, st.none() | st.binary(max_size=16))
def test_every_value_comes_back_as_sent(header: Every, body: bytes | None) -> None:
    payload = None if body is None else Payload(body)
    frames = encode(header, payload)
    assert codec(frames) == b"T"
    envelope = decode(frames)
    assert envelope.header == header
    assert type(envelope.header) is Every
    assert (envelope.payload is None) == (not body)
    fields = tuple(getattr(header, name) for name in Every.__slots__)  # type: ignore[attr-defined]
    assert decode(encode_fields(Every, fields, payload)).header == header


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(st.tuples(INT64, INT64, INT64), min_size=1, max_size=4), TEXT, INT64, st.data())
def test_headers_that_differ_only_in_leading_ints_come_back_as_sent(
    leads: list[tuple[int, int, int]], name: str, last: int, data: st.DataObject
) -> None:
    """What follows the leading ints is kept encoded and decoded: every header sharing it
    still comes back with its own leading ints, and a cut one is malformed."""
    for lead in leads:
        header = Leading(*lead, name, last, (last, 1))
        frames = encode(header)
        assert codec(frames) == b"L"
        assert decode(frames).header == header
        assert decode(encode_fields(Leading, (*lead, name, last, (last, 1)), None)).header == header
        prepared = prepare_header(Leading, (*lead[1:], name, last, (last, 1)))
        assert prepared is not None
        assert decode(encode_prepared(prepared, lead[0], Payload(b"x"))).header == header
        frame = bytes(frames[0])
        head = frame[len(MAGIC) + 5 :]
        cut = data.draw(st.integers(min_value=0, max_value=len(head) - 1))
        with pytest.raises(MalformedMessage):
            decode([reframed(frame, head[:cut])])


@pytest.mark.parametrize(
    "header",
    [
        Every(2**63, "", None, (), 0, ()),  # past 64 bits
        Every(1, "\ud800", None, (), 0, ()),  # a lone surrogate is no UTF-8
        Every(1, "", None, ["a"], 0, ()),  # type: ignore[arg-type]
        Every(True, "", None, (), 0, ()),
    ],
    ids=["big int", "surrogate", "list", "bool"],
)
def test_a_value_a_binary_header_cannot_hold_still_travels(header: Every) -> None:
    frames = encode(header)
    assert codec(frames) != b"T"
    assert decode(frames).header == header


def binary_frame(header: Every) -> bytes:
    return bytes(encode(header)[0])


def reframed(frame: bytes, head: bytes) -> bytes:
    """`frame` with its header replaced by `head` (the prefix's length follows it)."""
    prefix = len(MAGIC) + 5
    return MAGIC + struct.pack("<I", len(head)) + frame[prefix - 1 : prefix] + head


@settings(max_examples=300, deadline=None, database=None)
@given(EVERY, st.data())
def test_a_truncated_binary_header_is_malformed(header: Every, data: st.DataObject) -> None:
    frame = binary_frame(header)
    head = frame[len(MAGIC) + 5 :]
    cut = data.draw(st.integers(min_value=0, max_value=len(head) - 1))
    with pytest.raises(MalformedMessage):
        decode([reframed(frame, head[:cut])])


@settings(max_examples=500, deadline=None, database=None)
@given(EVERY, st.data())
def test_a_corrupted_binary_header_is_refused_or_decoded(
    header: Every, data: st.DataObject
) -> None:
    """Bytes overwritten anywhere in the header: MalformedMessage, or an Every whose fields
    have their declared types (a corrupted int is still an int), never anything else."""
    frame = binary_frame(header)
    head = bytearray(frame[len(MAGIC) + 5 :])
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        at = data.draw(st.integers(min_value=0, max_value=len(head) - 1))
        head[at] = data.draw(st.integers(min_value=0, max_value=255))
    extra = data.draw(st.binary(max_size=8))
    try:
        decoded = decode([reframed(frame, bytes(head) + extra)]).header
    except MalformedMessage:
        return
    assert type(decoded) is Every
    assert wire.invalid_fields(decoded) is None


@pytest.mark.parametrize(
    "head",
    [
        b"",
        b"\x01" * 15,  # shorter than the two ints of a reply
        b"\x01" * 17,  # a byte past them
    ],
    ids=["empty", "short", "long"],
)
def test_a_malformed_reply_header_is_refused(head: bytes) -> None:
    frame = bytes(encode(wire.Reply(1, 2))[0])
    with pytest.raises(MalformedMessage, match="Reply"):
        decode([reframed(frame, head)])


@pytest.mark.timeout(60)
def test_a_proc_sent_malformed_binary_headers_keeps_serving(make_procs: Any) -> None:
    exposed = make_procs({"gpus": 1}).spawn("who", actors.Exposed)
    pid, address, mesh_id = exposed.reach.call_one().get(timeout=T)
    with raw_peer(address) as peer:
        call = bytes(encode(ping(mesh_id, peer.inbox.address))[0])
        head = call[len(MAGIC) + 5 :]
        assert codec([call]) == b"C"
        for bad in (
            head[:10],  # truncated in the ints
            head[:-3],  # truncated in the last field
            head[:8] + b"\xff\xff\xff\x7f" + head[12:],  # a reply address of 2 GB
            head[:8] + b"\x02\x00\x00\x00\xff\xfe" + head[14:],  # not UTF-8
        ):
            peer.send([reframed(call, bad)])
        answer = peer.answer(ping(mesh_id, peer.inbox.address))
        assert type(answer.header) is wire.Reply and answer.header.rank == 0
    assert exposed.reach.call_one().get(timeout=T)[0] == pid


def test_long_headers_come_back_as_sent_every_time() -> None:
    """Headers too long to be kept encoded (hundreds of bytes of names) take the slow path
    each time, with the same result."""
    header = Every(3, "n" * 600, "é" * 300, ("x" * 200,) * 3, -1, tuple(range(100)))
    for call_id in range(3):
        sent = Every(call_id, *(getattr(header, n) for n in Every.__slots__[1:]))  # type: ignore[attr-defined]
        assert decode(encode(sent)).header == sent


@settings(max_examples=200, deadline=None, database=None)
@given(EVERY, st.lists(INT64, min_size=1, max_size=3), st.binary(max_size=16))
def test_a_prepared_header_sends_what_encode_fields_sends(
    header: Every, firsts: list[int], body: bytes
) -> None:
    """A header prepared once, sent with several first fields (call ids): the same frames
    as `encode_fields` makes for each."""
    rest = tuple(getattr(header, name) for name in Every.__slots__[1:])  # type: ignore[attr-defined]
    prepared = prepare_header(Every, rest)
    assert prepared is not None
    for first in firsts:
        frames = encode_prepared(prepared, first, Payload(body))
        assert frames == encode_fields(Every, (first, *rest), Payload(body))
        assert decode(frames).header == Every(first, *rest)


@settings(max_examples=200, deadline=None, database=None)
@given(
    st.builds(
        wire.CallActor,
        INT64,
        st.none() | TEXT,
        TEXT,
        TEXT,
        st.lists(TEXT, max_size=3).map(tuple),
        st.lists(INT64, max_size=3).map(tuple),
        INT64,
    ),
    st.lists(INT64, min_size=1, max_size=3),
    st.none() | st.binary(max_size=16),
    st.lists(st.binary(min_size=1, max_size=8), max_size=2),
)
def test_a_header_prepared_but_its_last_field_sends_what_encode_fields_sends(
    call: Any, lasts: list[int], body: bytes | None, buffers: list[bytes]
) -> None:
    """A call's header prepared once, sent with several ranks (its last field: a host agent
    delivering it to its procs): the same frames as `encode_fields` makes for each; a type
    whose last field is no int is not prepared."""
    fields = dataclasses.astuple(call)[:-1]
    prepared = prepare_header_but_last(wire.CallActor, fields)
    assert prepared is not None
    payload = None if body is None else Payload(body, buffers)
    for last in lasts:
        frames = encode_prepared_last(prepared, last, payload)
        assert frames == encode_fields(wire.CallActor, (*fields, last), payload)
        assert decode(frames).header == dataclasses.replace(call, rank=last)
    assert prepare_header_but_last(Every, (1, "", None, (), 0)) is None  # ends with a tuple


@settings(max_examples=200, deadline=None, database=None)
@given(
    INT64,
    st.none()
    | st.booleans()
    | INT64
    | st.floats()
    | TEXT
    | st.binary(max_size=4096)
    | st.lists(INT64, max_size=3)
    | st.builds(Every, INT64, TEXT, st.none(), st.just(()), INT64, st.just(())),
)
def test_a_prepared_value_sends_what_its_payload_sends(first: int, value: Any) -> None:
    """A result sent with a prepared header (`encode_prepared_value`, a scalar pickled
    inline): the same frames as `encode_prepared` of its `Payload.dump`."""
    prepared = prepare_header(Every, ("", None, (), 0, ()))
    assert prepared is not None
    want = encode_prepared(prepared, first, Payload.dump(value))
    got = encode_prepared_value(prepared, first, value)
    assert [bytes(f) for f in got] == [bytes(f) for f in want]


SCALAR = st.none() | st.booleans() | INT64 | st.floats() | TEXT | st.binary(max_size=4096)


@settings(max_examples=200, deadline=None, database=None)
@given(
    INT64,
    st.lists(SCALAR | st.lists(INT64, max_size=2), max_size=4),
    st.dictionaries(TEXT, SCALAR, max_size=2),
)
def test_prepared_arguments_send_what_their_payload_sends(
    first: int, args: list[Any], kwargs: dict[str, Any]
) -> None:
    """A call's arguments sent with a prepared header (`encode_prepared_arguments`, a few
    scalars pickled inline): the same frames as `encode_prepared` of `dump_arguments`, or
    None (then the caller builds that payload) for anything else."""
    prepared = prepare_header(Every, ("", None, (), 0, ()))
    assert prepared is not None
    want = encode_prepared(prepared, first, dump_arguments(tuple(args), kwargs))
    got = encode_prepared_arguments(prepared, first, tuple(args), kwargs)
    inline = not kwargs and all(type(a) is not list and len(want) == 1 for a in args)
    assert (got is not None) == inline
    if got is not None:
        assert [bytes(f) for f in got] == [bytes(f) for f in want]


@pytest.mark.parametrize(
    ("kind", "rest"),
    [
        (Every, ("\ud800", None, (), 0, ())),  # a lone surrogate is no UTF-8
        (Every, ("", None, (), 2**63, ())),  # past 64 bits
        (Every, ("", None, ())),  # fields missing
        (wire.StopActor, ("reply", "actor", 0)),  # no binary header
    ],
    ids=["surrogate", "big int", "missing", "not binary"],
)
def test_a_header_that_cannot_be_prepared_is_none(kind: type, rest: tuple[Any, ...]) -> None:
    assert prepare_header(kind, rest) is None


def test_a_prepared_header_refuses_a_payload_past_the_limit() -> None:
    prepared = prepare_header(Every, ("", None, (), 0, ()))
    assert prepared is not None
    before = transport_settings()
    use_transport_settings(dataclasses.replace(before, max_message_bytes=100))
    try:
        with pytest.raises(MessageTooLarge, match="Every message of 101 bytes"):
            encode_prepared(prepared, 1, Payload(b"x" * 101))
        assert len(encode_prepared(prepared, 1, Payload(b"x" * 100))) == 1  # at the limit
        with pytest.raises(MessageTooLarge, match="Every message of"):
            encode_prepared_value(prepared, 1, "x" * 101)
    finally:
        use_transport_settings(before)


@pytest.mark.timeout(60)
def test_a_proc_answers_each_call_with_its_own_id_and_rank(make_procs: Any) -> None:
    """A proc packs each reply's call id into a header it prepared for the call's rank: every
    call id and rank comes back as sent, in order (ids past 64 bits travel with a marshal
    header both ways), also when pipelined calls make their replies wait in batches."""
    exposed = make_procs({"gpus": 1}).spawn("who", actors.Exposed)
    _, address, mesh_id = exposed.reach.call_one().get(timeout=T)
    ranks, ids = (0, 7, 2**62, 7), (1, -(2**63), 2**63 - 1, 2**64, -(2**70), 2)
    sent = [(call_id, rank) for rank in ranks for call_id in ids]
    labels, sizes = ("x",), (2**63 - 1,)
    with raw_peer(address) as peer:
        reply_to, got = peer.inbox.address, []
        for call_id, rank in sent:
            call = wire.CallActor(call_id, reply_to, mesh_id, "__ping__", labels, sizes, rank)
            peer.send(encode(call))
        while len(got) < len(sent):
            assert peer.inbox.poll(int(T * 1000)), f"answers missing after {got}"
            while (answer := peer.inbox.receive_nowait()) is not None:
                assert type(answer.header) is wire.Reply, answer
                got.append((answer.header.call_id, answer.header.rank))
    assert got == sent
