"""Headers prepared once: a caller that sends many messages differing only in their first
field (a call's id) encodes the rest once, then each message packs its id and joins prefix,
header and payload body in one copy (`encode_fields` hashes the fields and copies twice).
A receiver reads a one-frame message whose binary header holds only ints (a reply) with one
unpack of its prefix and those ints (`LoneShape`), building no header, payload or envelope.
A host agent delivering one call to many procs does the same with the last field (the rank
of each proc in the call: `prepare_header_but_last`)."""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _settings
from ._arguments import dump_value
from ._frames import _LENGTH, MAGIC, MAX_HEADER_BYTES, Payload, _binary_of, _counts_of, _framed
from ._serialize import _LIFT_MAX_ITEMS, _PLAIN_SCALARS, OUT_OF_BAND_MIN_BYTES
from ._settings import transport_settings

_I64 = struct.Struct("<q")


@dataclass(frozen=True, slots=True)
class PreparedHeader:
    """A binary `kind` header encoded but for its first field (an int)."""

    kind: type
    codec: bytes
    lead: bytes  # the frame prefix: magic, header length, codec byte
    tail: bytes  # the fields after the first


@dataclass(frozen=True, slots=True)
class LoneShape:
    """How a one-frame `kind` message starts: `unpack_from(frame)` reads its prefix, which
    must equal `lead`, and its header's ints at once; its payload body follows at `size`."""

    kind: type
    lead: bytes
    unpack_from: Callable[..., tuple[Any, ...]]  # (buffer, offset=0)
    size: int


def lone_shape(kind: type) -> LoneShape:
    """The `LoneShape` of `kind`, a message type whose binary header holds only ints."""
    binary = _binary_of.get(kind)
    if binary is None or not binary[1].ints_only:
        raise TypeError(f"{kind.__qualname__} has no binary header made only of ints")
    count = _counts_of[kind]
    lead = MAGIC + _LENGTH.pack(_I64.size * count) + binary[0]
    head = struct.Struct(f"<{len(lead)}s{count}q")
    return LoneShape(kind, lead, head.unpack_from, head.size)


def prepare_header(kind: type, rest: tuple[Any, ...]) -> PreparedHeader | None:
    """The header of `kind` messages whose fields after the first are `rest`; None when
    `kind` has no binary header, or `rest` does not fit it (then use `encode_fields`, which
    says what is wrong)."""
    binary = _binary_of.get(kind)
    if binary is None or len(rest) + 1 != _counts_of[kind]:
        return None
    codec, layout, _ = binary
    try:
        tail = layout.encode_rest(rest)
    except struct.error:  # an int past 64 bits
        return None
    if tail is None or _I64.size + len(tail) > MAX_HEADER_BYTES:
        return None
    return PreparedHeader(kind, codec, MAGIC + _LENGTH.pack(_I64.size + len(tail)) + codec, tail)


def encode_prepared(header: PreparedHeader, first: int, payload: Payload) -> list[Any]:
    """The frames of the message of `header` whose first field is `first` (as `encode`)."""
    size = payload.nbytes if payload.buffers else len(payload.body)
    settings = _settings.current
    if size > (settings or transport_settings()).max_message_bytes:  # raises MessageTooLarge:
        return _framed(header.kind, header.codec, _I64.pack(first) + header.tail, payload, None)
    frame = b"".join((header.lead, _I64.pack(first), header.tail, payload.body))
    return [frame, *payload.buffers] if payload.buffers else [frame]


def encode_prepared_value(header: PreparedHeader, first: int, value: Any) -> list[Any]:
    """`encode_prepared(header, first, dump_value(value))`: the same frames, with a scalar's
    pickling inline (a reply to a call: one Python call where that made three)."""
    kind = type(value)
    if kind in _PLAIN_SCALARS or (kind is bytes and len(value) < OUT_OF_BAND_MIN_BYTES):
        body = pickle.dumps(value, protocol=5)
        settings = _settings.current
        if len(body) <= (settings or transport_settings()).max_message_bytes:
            return [b"".join((header.lead, _I64.pack(first), header.tail, body))]
    return encode_prepared(header, first, dump_value(value))


def encode_prepared_arguments(
    header: PreparedHeader, first: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[Any] | None:
    """The frames of `encode_prepared(header, first, dump_arguments(args, kwargs))` when
    the arguments are a few scalars (pickled inline, no payload built: once per call to one
    actor); None for any others (then build their payload)."""
    if kwargs or len(args) > _LIFT_MAX_ITEMS:
        return None
    for item in args:  # as `dump_arguments` looks at them, scalars only
        kind = type(item)
        if kind not in _PLAIN_SCALARS and (kind is not bytes or len(item) >= OUT_OF_BAND_MIN_BYTES):
            return None
    body = pickle.dumps((args, kwargs), protocol=5)
    settings = _settings.current
    if len(body) > (settings or transport_settings()).max_message_bytes:
        return None  # (`encode_prepared` says so)
    return [b"".join((header.lead, _I64.pack(first), header.tail, body))]


def prepare_header_but_last(kind: type, fields: tuple[Any, ...]) -> PreparedHeader | None:
    """The header of `kind` messages whose fields but the last (an int) are `fields`, for
    `encode_prepared_last`; None when `kind` has no binary header, its last field is no int
    or `fields` do not fit it (then use `encode_fields`, which says what is wrong)."""
    binary = _binary_of.get(kind)
    if binary is None or len(fields) + 1 != _counts_of[kind]:
        return None
    codec, layout, _ = binary
    zero, one = layout.encode((*fields, 0)), layout.encode((*fields, 1))
    if zero is None or one is None or len(zero) > MAX_HEADER_BYTES:
        return None
    head = zero[: -_I64.size]
    if zero != head + _I64.pack(0) or one != head + _I64.pack(1):  # the last field, packed
        return None
    return PreparedHeader(kind, codec, MAGIC + _LENGTH.pack(len(zero)) + codec + head, b"")


def encode_prepared_last(header: PreparedHeader, last: int, payload: Payload | None) -> list[Any]:
    """The frames of the message of `header` (`prepare_header_but_last`) whose last field is
    `last` (as `encode_fields`): one pack and one join per message."""
    if payload is None:
        return [header.lead + _I64.pack(last)]
    size = payload.nbytes if payload.buffers else len(payload.body)
    settings = _settings.current
    if size > (settings or transport_settings()).max_message_bytes:  # raises MessageTooLarge
        return _framed(header.kind, header.codec, b"", payload, None)
    frame = b"".join((header.lead, _I64.pack(last), payload.body))
    return [frame, *payload.buffers] if payload.buffers else [frame]
