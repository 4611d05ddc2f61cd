"""Framing: a typed header frame, a pickle body frame and zero-copy buffer frames.

Wire layout of one message (a zmq multipart message)::

    frame 0   b"MV" + version byte + pickle of the header (a registered message type)
    frame 1   optional: the payload's pickle body (cloudpickle, protocol 5)
    frame 2.. optional: the payload's out-of-band buffers, one frame each

Headers are decoded eagerly and must be of a registered message type; payloads are decoded
lazily by whoever handles the message, so a payload that cannot be unpickled is reported to its
sender instead of crashing the receiver. (Pickle runs code: peers are trusted, which is why tcp
across hosts is authenticated.)
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import _serialize
from ._errors import MalformedMessage, MessageTooLarge

MAGIC = b"MV\x01"
DEFAULT_MAX_MESSAGE_BYTES = int(os.environ.get("MESHVISOR_MAX_MESSAGE_BYTES", 1 << 30))

_T = TypeVar("_T", bound=type)
_registered: set[type] = set()


def message_type(cls: _T) -> _T:
    """Register `cls` as a header type that receivers may decode."""
    _registered.add(cls)
    return cls


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


def encode(header: Any, payload: Payload | None = None, *,
           max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[Any]:
    """Frames for `header` and `payload`; raises MessageTooLarge past `max_bytes`."""
    frames: list[Any] = [MAGIC + pickle.dumps(header, protocol=5)]
    if payload is not None:
        size = payload.nbytes
        if size > max_bytes:
            raise MessageTooLarge(
                f"a {type(header).__name__} message of {size} bytes exceeds the limit of "
                f"{max_bytes} bytes; send large data in pieces or raise the limit with "
                "MESHVISOR_MAX_MESSAGE_BYTES."
            )
        frames.append(payload.body)
        frames.extend(payload.buffers)
    return frames


def decode(frames: Sequence[Any], *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Envelope:
    """Decode received frames (bytes or zmq.Frame); raises MalformedMessage when invalid."""
    if not frames:
        raise MalformedMessage("received an empty message")
    views = [memoryview(f) for f in frames]
    size = sum(v.nbytes for v in views)
    if size > max_bytes:
        raise MessageTooLarge(f"received a message of {size} bytes, over the limit of {max_bytes}")
    head = views[0]
    if head[: len(MAGIC)] != MAGIC:
        raise MalformedMessage(
            f"received a frame without the meshvisor header (starts with {bytes(head[:8])!r})"
        )
    try:
        header = pickle.loads(head[len(MAGIC):])
    except Exception as exc:
        raise MalformedMessage(f"cannot decode a message header: {exc}") from exc
    if type(header) not in _registered:
        raise MalformedMessage(f"received a header of unknown type {type(header).__name__}")
    payload = Payload(views[1], views[2:]) if len(views) > 1 else None
    return Envelope(header, payload)
