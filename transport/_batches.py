"""Batches: several small messages to one address carried by one zmq frame.

A message costs its sender and its receiver a zmq send, a receive and often a thread wake-up
each, whatever its size. When a sender knows its peer is busy (it has not answered earlier
messages yet), waiting a moment changes nothing for the message's own latency, so the outbox
keeps such messages (`Outbox.send_soon`) and sends them together: on the next ordinary send to
that address (before it, so that order holds), when a batch is full, or at the next `flush`,
which the sender arranges to come soon (its event loop's next turn, or before it waits).

Wire layout of a batch frame::

    b"MB" + version byte + count (u32 little-endian) + count times (length u32 + message)

where each message is the single frame `encode` made (header and in-band payload). Only
single-frame messages are batched: out-of-band buffers travel as frames of their own.
Receivers split a batch into its messages and decode each, in order, as if each had come
alone: a malformed message is dropped alone; a malformed batch is dropped whole.
"""

from __future__ import annotations

import struct
from typing import Any

from ._errors import MalformedMessage

BATCH_MAGIC = b"MB\x01"
_U32 = struct.Struct("<I")
_PREFIX = len(BATCH_MAGIC) + _U32.size
#: A batch is sent as soon as it holds this many messages...
MAX_BATCH_MESSAGES = 64
#: ... or this many bytes (small messages only: a larger one is sent on its own).
MAX_BATCH_BYTES = 64 << 10


class Batch:
    """The messages waiting for one address, in the order they were sent."""

    __slots__ = ("frames", "nbytes")

    def __init__(self) -> None:
        self.frames: list[Any] = []
        self.nbytes = 0

    def add(self, frame: Any) -> bool:
        """Keep `frame`; whether the batch is now full (and must be sent)."""
        self.frames.append(frame)
        self.nbytes += len(frame)
        return len(self.frames) >= MAX_BATCH_MESSAGES or self.nbytes >= MAX_BATCH_BYTES

    def packed(self) -> Any:
        """The one frame that carries these messages (a lone message goes as it is)."""
        frames = self.frames
        if len(frames) == 1:
            return frames[0]
        parts = [BATCH_MAGIC, _U32.pack(len(frames))]
        for frame in frames:
            parts.append(_U32.pack(len(frame)))
            parts.append(frame)
        return b"".join(parts)


def split_batch_or_none(frame: memoryview, log: Any, address: str) -> list[memoryview]:
    """The messages of a batch frame; none (logged) when the batch is malformed."""
    try:
        return split_batch(frame)
    except MalformedMessage as exc:
        log.warning("message_dropped", address=address, reason=str(exc), frames=1)
        return []


def split_batch(frame: memoryview) -> list[memoryview]:
    """The messages of a batch frame, in order; MalformedMessage when its counts and
    lengths do not add up to its size."""
    end = frame.nbytes
    if end < _PREFIX:
        raise MalformedMessage("a truncated batch: it ends before its message count")
    (count,) = _U32.unpack_from(frame, len(BATCH_MAGIC))
    if count > (end - _PREFIX) // _U32.size:
        raise MalformedMessage(f"a batch declares {count} messages, more than its size can hold")
    bounds, position = [], _PREFIX
    for _ in range(count):
        if position + _U32.size > end:
            raise MalformedMessage("a truncated batch: a message length runs past its end")
        (length,) = _U32.unpack_from(frame, position)
        position += _U32.size
        if length > end - position:
            raise MalformedMessage(
                f"a batch message declares {length} bytes, more than the {end - position} left"
            )
        bounds.append((position, position + length))
        position += length
    if position != end:
        raise MalformedMessage(f"a batch has {end - position} bytes after its last message")
    return [frame[start:stop] for start, stop in bounds]
