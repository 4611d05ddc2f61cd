"""Framing: a typed header frame, a pickle body frame and zero-copy buffer frames.

Wire layout of one message (a zmq multipart message)::

    frame 0   b"MV" + version byte (WIRE_VERSION) + header length (u32 little-endian) + codec byte +
              the header (a registered message type: marshal of its name and fields, see
              below) + the payload's pickle body (may be empty)
    frame 1.. the payload's out-of-band buffers, one zero-copy frame each

Small messages are therefore a single frame, the cheapest thing zmq can move.

Headers are decoded eagerly, never with pickle. The hot messages (a call, its reply) have a
binary header, packed with `struct` and marked by a codec byte of their own (see `_binary`:
lengths checked against the frame, no code run). Any other header is the marshal of a tuple
``(type name, *fields)`` of plain values (None, bool, int, float, str, bytes, tuple, list,
dict, set, frozenset). Codec ``m`` holds only plain values; codec ``n`` also holds registered
messages nested in its fields, each written as the tuple ``(..., type name, *fields)``. Before
marshal reads a header, a scan of its bytes rejects every marshal type outside that set (code
objects included) and every declared length or item count larger than the bytes left, so a
header can neither run code nor make the receiver allocate more than a small multiple of its
size (at most MAX_HEADER_BYTES). Only registered message types come out.

Payloads are decoded lazily by whoever handles the message, so a payload that cannot be
unpickled is reported to its sender instead of crashing the receiver. Pickle runs code, so
payloads come only from authenticated peers: every tcp inbox is a CURVE server, and ipc
sockets live in private directories.
"""

from __future__ import annotations

import dataclasses
import marshal
import operator
import struct
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import _serialize, _settings
from ._batches import BATCH_MAGIC
from ._binary import BinaryLayout, layout_kinds
from ._errors import MalformedMessage, MessageTooLarge, SerializationError, WireVersionMismatch
from ._marshal_scan import check_marshal
from ._message_methods import fill_in_methods
from ._settings import TransportSettings, transport_settings

#: The version of this framing, the byte after b"MV": bumped whenever what a peer of the old
#: version cannot read changes (6: shared calls' rank moved last; tests/test_wire_version.py).
WIRE_VERSION = 6
MAGIC = b"MV" + bytes([WIRE_VERSION])
_LENGTH = struct.Struct("<I")
_PREFIX = len(MAGIC) + _LENGTH.size + 1
_HEAD = struct.Struct("<3sIB")  # the prefix: magic, header length, codec
_MARSHAL, _NESTED = b"m", b"n"
_MARSHAL_CODE, _NESTED_CODE = _MARSHAL[0], _NESTED[0]
#: The default largest message (MESHVISOR_MAX_MESSAGE_BYTES, `TransportSettings`, overrides it).
DEFAULT_MAX_MESSAGE_BYTES = TransportSettings.max_message_bytes
#: The largest header a receiver decodes (a SpawnProcs of thousands of procs is far smaller).
MAX_HEADER_BYTES = 4 << 20
#: Headers nest registered messages at most this deep (SpawnProcs → ProcSpec is 1).
_MAX_NESTING = 8
#: The types of values that hold nothing: a tuple of only these is sent and rebuilt as it is.
_SCALARS = frozenset({type(None), bool, int, float, str, bytes})

_T = TypeVar("_T", bound=type)
_registered: set[type] = set()
_by_name: dict[str, type] = {}
_fields_of: dict[type, Any] = {}
#: Builds a received message from its fields: ``build(values, start)``, see `_slot_builder`.
_builders: dict[str, Callable[[tuple[Any, ...], int], Any]] = {}
_names_of: dict[type, str] = {}
_counts_of: dict[type, int] = {}
_new = object.__new__
#: The types with a binary header (`binary_header`): by type, its codec byte and layout...
_binary_of: dict[type, tuple[bytes, BinaryLayout, Callable[[Any], tuple[Any, ...]]]] = {}
#: ... and by codec byte, its layout (which builds its messages too).
_binary_by_code: dict[int, BinaryLayout] = {}
_MEMBER_DESCRIPTOR = types.MemberDescriptorType


def message_type(cls: _T) -> _T:
    """Register `cls` (a slotted frozen dataclass) as a header type receivers may decode.
    Declared with ``repr=False, eq=False``, it gets those methods from its fields here, which
    makes it cheaper to create (`fill_in_methods`)."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    values: Any = operator.attrgetter(*names) if len(names) > 1 else None

    def reduce(self: Any) -> tuple[Any, tuple[Any, ...]]:  # pickling headers is the hot path
        if values is not None:
            return cls, values(self)
        return cls, tuple(getattr(self, name) for name in names)

    cls.__reduce__ = reduce  # type: ignore[method-assign,assignment]
    fill_in_methods(cls, names)
    name = f"{cls.__module__}.{cls.__qualname__}"
    _registered.add(cls)
    _by_name[name] = cls
    _builders[name] = _slot_builder(cls, names)
    _names_of[cls], _counts_of[cls] = name, len(names)
    if values is not None:
        _fields_of[cls] = lambda header: (name, *values(header))
    else:
        _fields_of[cls] = lambda header: (name, *reduce(header)[1])
    return cls


def binary_header(code: bytes) -> Callable[[_T], _T]:
    """Give a registered message type a binary header (`_binary`), marked by codec byte
    `code`: for the hot messages, whose fields are ints, strs and tuples of them."""

    def register(cls: _T) -> _T:
        if cls not in _registered:
            raise TypeError(f"register {cls.__qualname__} with @message_type first")
        if len(code) != 1 or code in (_MARSHAL, _NESTED) or code[0] in _binary_by_code:
            raise ValueError(f"codec byte {code!r} is taken or is not one byte")
        fields = dataclasses.fields(cls)
        names = tuple(f.name for f in fields)
        types = tuple(f.type if isinstance(f.type, str) else f.type.__name__ for f in fields)
        slotted = _built_by_slots(cls, names)
        setters = tuple(_slot_setter(cls, n) for n in names) if slotted else None
        layout = BinaryLayout(cls, names, layout_kinds(cls, types), setters)
        values = (
            operator.attrgetter(*names) if len(names) > 1 else lambda m: (getattr(m, names[0]),)
        )
        _binary_of[cls] = code, layout, values
        _binary_by_code[code[0]] = layout
        return cls

    return register


def _encode_header(header: Any) -> tuple[bytes, bytes]:
    """(codec, bytes): the binary header of a type that has one, else marshal of the
    header's name and fields, nested messages as tuples."""
    binary = _binary_of.get(type(header))
    if binary is not None:
        head = binary[1].encode(binary[2](header))
        if head is not None:
            return binary[0], head
    fields = _fields_of.get(type(header))
    if fields is None:
        raise SerializationError(
            f"cannot send a {type(header).__qualname__} header: only types registered with "
            "@message_type can be headers"
        )
    values = fields(header)
    try:
        return _MARSHAL, marshal.dumps(values)
    except ValueError:  # a field holds a nested message (or something a header cannot hold)
        pass
    try:
        return _NESTED, marshal.dumps(_plain(values))
    except ValueError:
        raise SerializationError(
            f"cannot send a {type(header).__qualname__} header: its fields must hold plain "
            "values (None, bool, int, float, str, bytes, tuple, list, dict, set, frozenset) "
            f"or registered messages, not {values!r}"
        ) from None


def _plain(value: Any) -> Any:
    """`value` with every registered message in it replaced by ``(..., name, *fields)``."""
    fields = _fields_of.get(type(value))
    if fields is not None:
        return (..., *(_plain(v) for v in fields(value)))
    if type(value) is tuple:  # one of scalars holds nothing to replace (tested in C)
        return value if _SCALARS.issuperset(map(type, value)) else tuple(map(_plain, value))
    if type(value) is list:
        return [_plain(v) for v in value]
    if type(value) is dict:
        return {k: _plain(v) for k, v in value.items()}
    return value


def _refuse_prefix(first: memoryview) -> None:
    """Raise why a first frame without this version's magic is refused."""
    for magic, what in ((MAGIC, "a message"), (BATCH_MAGIC, "a batch")):
        if first.nbytes >= len(magic) and first[:2] == magic[:2] and first[2] != magic[2]:
            raise WireVersionMismatch(
                f"received {what} of wire version {first[2]}, but this process speaks version "
                f"{magic[2]}: every process of an allocation must run the same meshvisor "
                "release (upgrade the older one)"
            )
    raise MalformedMessage(
        f"received a frame without the meshvisor header (starts with {bytes(first[:8])!r})"
    )


def _decode_header(codec: int, data: memoryview) -> Any:
    if codec != _MARSHAL_CODE and codec != _NESTED_CODE:
        raise MalformedMessage(f"unknown header encoding {bytes([codec])!r}")
    check_marshal(data)
    values = marshal.loads(data)
    if codec == _NESTED_CODE:
        return _rebuilt((..., *values) if type(values) is tuple else values, 0)
    return _message(values, 0)


def _slot_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """Sets slot `name` of a `cls` instance, even a frozen one (only while building it)."""
    setter: Callable[[Any, Any], None] = vars(cls)[name].__set__
    return setter


def _message(values: Any, start: int) -> Any:
    """The registered message `values[start:]` names, built from the fields that follow."""
    build = _builders.get(values[start]) if type(values) is tuple and len(values) > start else None
    if build is None:
        raise MalformedMessage(f"received a header of unknown type {values[start : start + 1]!r}")
    return build(values, start + 1)


def _built_by_slots(cls: type, names: tuple[str, ...]) -> bool:
    """Whether a `cls` can be built by setting its slots (its ``__init__`` does nothing else)."""
    slotted = all(type(vars(cls).get(name)) is _MEMBER_DESCRIPTOR for name in names)
    return slotted and not hasattr(cls, "__post_init__")


def _slot_builder(cls: type, names: tuple[str, ...]) -> Callable[[tuple[Any, ...], int], Any]:
    """``build(values, start)``: a `cls` whose fields are ``values[start:]``, set through its
    slots, which takes half the time of a frozen dataclass's ``__init__`` (one per message
    received). A class with a ``__post_init__`` or without slots is built by its ``__init__``."""
    if not _built_by_slots(cls, names):
        return lambda values, start: cls(*values[start:])
    set_field = tuple(_slot_setter(cls, name) for name in names)
    count = len(names)

    def build(values: tuple[Any, ...], start: int) -> Any:
        if len(values) - start != count:
            raise MalformedMessage(
                f"a {cls.__name__} header holds {len(values) - start} fields, not {count}"
            )
        message: Any = _new(cls)
        for setter in set_field:  # indexing: twice as fast as zipping with a slice
            setter(message, values[start])
            start += 1
        return message

    return build


def _rebuilt(value: Any, depth: int) -> Any:
    """`value` with every ``(..., name, *fields)`` tuple turned back into its message."""
    if depth > _MAX_NESTING:
        raise MalformedMessage(f"a header nests messages deeper than {_MAX_NESTING} levels")
    kind = type(value)
    if kind is tuple:
        if _SCALARS.issuperset(map(type, value)):  # no message, nothing nested: tested in C
            return value
        rebuilt = tuple(_rebuilt(v, depth + 1) for v in value)
        return _message(rebuilt, 1) if value and value[0] is ... else rebuilt
    if kind is list:
        return [_rebuilt(v, depth + 1) for v in value]
    if kind is dict:
        return {k: _rebuilt(v, depth + 1) for k, v in value.items()}
    return value


@dataclass(frozen=True, slots=True)
class Payload:
    """A serialized value: a pickle body plus out-of-band buffers. Pickle once, send many."""

    body: bytes | memoryview
    buffers: Sequence[Any] = field(default=())

    @classmethod
    def dump(cls, value: Any) -> Payload:
        return _payload(*_serialize.dumps(value))

    def load(self) -> Any:
        return _serialize.loads(self.body, self.buffers)

    @property
    def nbytes(self) -> int:
        return len(self.body) + sum(memoryview(b).nbytes for b in self.buffers)


@dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded message: its typed header and its (still serialized) payload."""

    header: Any
    payload: Payload | None


# Built through their slots on the hot paths: a third of the time of their ``__init__``.
_set_body, _set_buffers = _slot_setter(Payload, "body"), _slot_setter(Payload, "buffers")
_set_header, _set_payload = _slot_setter(Envelope, "header"), _slot_setter(Envelope, "payload")


def _payload(body: bytes | memoryview, buffers: Sequence[Any]) -> Payload:
    payload = _new(Payload)
    _set_body(payload, body)
    _set_buffers(payload, buffers)
    return payload


def encode(
    header: Any, payload: Payload | None = None, *, max_bytes: int | None = None
) -> list[Any]:
    """Frames for `header` and `payload`; raises MessageTooLarge past `max_bytes` (default: this
    process's `TransportSettings.max_message_bytes`)."""
    codec, head = _encode_header(header)
    return _framed(type(header), codec, head, payload, max_bytes)


def encode_fields(kind: type, fields: tuple[Any, ...], payload: Payload | None) -> list[Any]:
    """`encode` of a `kind` header whose fields are `fields` (plain values, in the order the
    class declares them), without building the header: the hot paths (a call, its reply)."""
    name = _names_of.get(kind)
    if name is None or len(fields) != _counts_of[kind]:
        raise SerializationError(
            f"cannot send a {kind.__qualname__} header made of {len(fields)} fields: it must be "
            "a type registered with @message_type, given every field it declares"
        )
    binary = _binary_of.get(kind)
    if binary is not None:
        head = binary[1].encode(fields)
        if head is not None:
            return _framed(kind, binary[0], head, payload, None)
    try:
        head = marshal.dumps((name, *fields))
    except ValueError:
        raise SerializationError(
            f"cannot send a {kind.__qualname__} header: its fields must hold plain values, "
            f"not {fields!r}"
        ) from None
    return _framed(kind, _MARSHAL, head, payload, None)


def _framed(
    kind: type, codec: bytes, head: bytes, payload: Payload | None, max_bytes: int | None
) -> list[Any]:
    """The frames of a message whose header (`kind`) was encoded as `head` with `codec`."""
    if len(head) > MAX_HEADER_BYTES:
        raise MessageTooLarge(
            f"a {kind.__name__} header of {len(head)} bytes exceeds the limit of "
            f"{MAX_HEADER_BYTES} bytes on headers; put large values in the payload"
        )
    if payload is None:
        return [b"".join((MAGIC, _LENGTH.pack(len(head)), codec, head))]
    size = payload.nbytes if payload.buffers else len(payload.body)
    if max_bytes is None:  # `transport_settings()` without its call, once per message sent
        settings = _settings.current
        max_bytes = (settings or transport_settings()).max_message_bytes
    if size > max_bytes:
        raise MessageTooLarge(
            f"a {kind.__name__} message of {size} bytes exceeds the limit of "
            f"{max_bytes} bytes; send large data in pieces or raise the limit with "
            "MESHVISOR_MAX_MESSAGE_BYTES."
        )
    first = b"".join((MAGIC, _LENGTH.pack(len(head)), codec, head, payload.body))
    return [first, *payload.buffers] if payload.buffers else [first]


def decode(frames: Sequence[Any], *, max_bytes: int | None = None) -> Envelope:
    """Decode received frames (bytes or zmq.Frame); raises MalformedMessage when invalid."""
    if not frames:
        raise MalformedMessage("received an empty message")
    first = memoryview(frames[0])
    buffers = [memoryview(f) for f in frames[1:]] if len(frames) > 1 else []
    size = first.nbytes + sum(v.nbytes for v in buffers) if buffers else first.nbytes
    if max_bytes is None:
        max_bytes = transport_settings().max_message_bytes
    if size > max_bytes:
        raise MessageTooLarge(f"received a message of {size} bytes, over the limit of {max_bytes}")
    magic, length, codec = _HEAD.unpack_from(first) if first.nbytes >= _PREFIX else (b"", 0, 0)
    if magic != MAGIC:
        _refuse_prefix(first)
    if length > MAX_HEADER_BYTES:
        raise MessageTooLarge(
            f"received a header of {length} bytes, over the limit of {MAX_HEADER_BYTES}"
        )
    end = _PREFIX + length
    if end > first.nbytes:
        raise MalformedMessage(
            f"truncated message: the header claims {length} bytes but the "
            f"frame holds {first.nbytes - _PREFIX}"
        )
    binary = _binary_by_code.get(codec)
    try:  # a binary header (the hot messages) decoded here: `_decode_header` does the others
        if binary is not None:  # (its layout builds a registered type)
            header = binary.decode_message(first, _PREFIX, end)
        else:
            header = _decode_header(codec, first[_PREFIX:end])
    except MalformedMessage:
        raise
    except Exception as exc:
        raise MalformedMessage(f"cannot decode a message header: {exc!r}") from exc
    if binary is None and type(header) not in _registered:
        raise MalformedMessage(f"received a header of unknown type {type(header).__name__}")
    body = first[end:]
    envelope, payload = _new(Envelope), _new(Payload) if body.nbytes or buffers else None
    _set_header(envelope, header)  # built here, not by `_payload`: two calls per message
    _set_payload(envelope, payload)
    if payload is not None:
        _set_body(payload, body)
        _set_buffers(payload, buffers)
    return envelope
