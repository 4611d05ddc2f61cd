"""Framing: a typed header frame, a pickle body frame and zero-copy buffer frames.

Wire layout of one message (a zmq multipart message)::

    frame 0   b"MV" + version byte + header length (u32 little-endian) + codec byte +
              the header (a registered message type: marshal of its name and fields when
              they are plain values, else pickle) + the payload's pickle body (may be empty)
    frame 1.. the payload's out-of-band buffers, one zero-copy frame each

Small messages are therefore a single frame, the cheapest thing zmq can move.

Headers are decoded eagerly and must be of a registered message type; payloads are decoded
lazily by whoever handles the message, so a payload that cannot be unpickled is reported to its
sender instead of crashing the receiver. (Pickle runs code: peers are trusted, which is why tcp
across hosts is authenticated.)
"""

from __future__ import annotations

import dataclasses
import marshal
import operator
import os
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import _serialize
from ._errors import MalformedMessage, MessageTooLarge

MAGIC = b"MV\x03"
_LENGTH = struct.Struct("<I")
_PREFIX = len(MAGIC) + _LENGTH.size + 1
_MARSHAL, _PICKLE = b"m", b"p"
DEFAULT_MAX_MESSAGE_BYTES = int(os.environ.get("MESHVISOR_MAX_MESSAGE_BYTES", 1 << 30))

_T = TypeVar("_T", bound=type)
_registered: set[type] = set()
_by_name: dict[str, type] = {}
_fields_of: dict[type, Any] = {}


def message_type(cls: _T) -> _T:
    """Register `cls` (a slotted frozen dataclass) as a header type receivers may decode."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    values: Any = operator.attrgetter(*names) if len(names) > 1 else None

    def reduce(self: Any) -> tuple[Any, tuple[Any, ...]]:  # pickling headers is the hot path
        if values is not None:
            return cls, values(self)
        return cls, tuple(getattr(self, name) for name in names)

    cls.__reduce__ = reduce  # type: ignore[method-assign,assignment]
    name = f"{cls.__module__}.{cls.__qualname__}"
    _registered.add(cls)
    _by_name[name] = cls
    _fields_of[cls] = lambda header: (name, *reduce(header)[1])
    return cls


def _encode_header(header: Any) -> tuple[bytes, bytes]:
    """(codec, bytes): marshal for headers of plain values, the fast common case."""
    fields = _fields_of.get(type(header))
    if fields is not None:
        try:
            return _MARSHAL, marshal.dumps(fields(header))
        except ValueError:  # a field holds something marshal cannot write (nested messages)
            pass
    return _PICKLE, pickle.dumps(header, protocol=5)


def _decode_header(codec: bytes | memoryview, data: memoryview) -> Any:
    if codec == _MARSHAL:
        values = marshal.loads(data)
        cls = _by_name.get(values[0]) if type(values) is tuple and values else None
        if cls is None:
            raise MalformedMessage(f"received a header of unknown type {values[:1]!r}")
        return cls(*values[1:])
    if codec == _PICKLE:
        return pickle.loads(data)
    raise MalformedMessage(f"unknown header encoding {codec!r}")


@dataclass(frozen=True, slots=True)
class Payload:
    """A serialized value: a pickle body plus out-of-band buffers. Pickle once, send many."""

    body: bytes | memoryview
    buffers: Sequence[Any] = field(default=())

    @classmethod
    def dump(cls, value: Any) -> Payload:
        body, buffers = _serialize.dumps(value)
        return cls(body, buffers)

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


def encode(
    header: Any, payload: Payload | None = None, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> list[Any]:
    """Frames for `header` and `payload`; raises MessageTooLarge past `max_bytes`."""
    codec, head = _encode_header(header)
    if payload is None:
        return [MAGIC + _LENGTH.pack(len(head)) + codec + head]
    size = payload.nbytes
    if size > max_bytes:
        raise MessageTooLarge(
            f"a {type(header).__name__} message of {size} bytes exceeds the limit of "
            f"{max_bytes} bytes; send large data in pieces or raise the limit with "
            "MESHVISOR_MAX_MESSAGE_BYTES."
        )
    return [MAGIC + _LENGTH.pack(len(head)) + codec + head + payload.body, *payload.buffers]


def decode(frames: Sequence[Any], *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Envelope:
    """Decode received frames (bytes or zmq.Frame); raises MalformedMessage when invalid."""
    if not frames:
        raise MalformedMessage("received an empty message")
    first = memoryview(frames[0])
    buffers = [memoryview(f) for f in frames[1:]] if len(frames) > 1 else []
    size = first.nbytes + sum(v.nbytes for v in buffers) if buffers else first.nbytes
    if size > max_bytes:
        raise MessageTooLarge(f"received a message of {size} bytes, over the limit of {max_bytes}")
    if first.nbytes < _PREFIX or first[: len(MAGIC)] != MAGIC:
        raise MalformedMessage(
            f"received a frame without the meshvisor header (starts with {bytes(first[:8])!r})"
        )
    (length,) = _LENGTH.unpack_from(first, len(MAGIC))
    if _PREFIX + length > first.nbytes:
        raise MalformedMessage(
            f"truncated message: the header claims {length} bytes but the "
            f"frame holds {first.nbytes - _PREFIX}"
        )
    try:
        header = _decode_header(first[_PREFIX - 1 : _PREFIX], first[_PREFIX : _PREFIX + length])
    except MalformedMessage:
        raise
    except Exception as exc:
        raise MalformedMessage(f"cannot decode a message header: {exc!r}") from exc
    if type(header) not in _registered:
        raise MalformedMessage(f"received a header of unknown type {type(header).__name__}")
    body = first[_PREFIX + length :]
    payload = Payload(body, buffers) if body.nbytes or buffers else None
    return Envelope(header, payload)
