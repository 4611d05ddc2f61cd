"""`KeyedInbox`: an inbox that hands over a lone call as its id, body and a value known for
the rest of its header, no objects built.

A proc receives most calls alone, each in one frame, and from one caller to one endpoint the
binary header differs only in its first int (the call id: see `_binary`). The receiver keeps
a value per header it has seen (`KeyedShape.key`: the encoded fields after the first); a
lone frame whose header bytes after the call id equal a kept key is handed over as that value,
the call id and the payload body, skipping the general decoding, the header, payload and
envelope objects. Nothing is decoded from an unknown header: it takes the general path.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from ._batches import BATCH_MAGIC, split_batch_or_none
from ._binary import BinaryLayout
from ._errors import MalformedMessage, MessageTooLarge, TransportError
from ._frames import (
    _HEAD,
    _PREFIX,
    MAGIC,
    Envelope,
    Payload,
    _binary_of,
    _new,
    _set_body,
    _set_buffers,
    _set_header,
    _set_payload,
    decode,
)
from ._sockets import _BATCH, _NOBLOCK, LONGEST_WAIT_MS, Inbox, _zmq_poll

#: The longest key kept: headers longer than this always take the general path.
LONGEST_KEY = 512

#: A message received by its key: (the key's value, the message's first int, its body).
Keyed = tuple[Any, int, memoryview]
#: A frame's prefix and first int (`KeyedShape.unpack_from` of any keyed shape).
_HEAD_Q = struct.Struct(_HEAD.format + "q").unpack_from


@dataclass(frozen=True, slots=True)
class KeyedShape:
    """How a one-frame `kind` message starts: its frame prefix and first int, read by one
    `unpack_from`; the rest of its header is the key (`key`)."""

    kind: type
    code: int
    unpack_from: Any
    size: int
    layout: BinaryLayout

    def key(self, rest: tuple[Any, ...]) -> bytes | None:
        """The key of the `kind` headers whose fields after the first are `rest` (None when
        they do not fit the binary layout, or make a key longer than `LONGEST_KEY`)."""
        try:
            tail = self.layout.encode_rest(rest)
        except struct.error:  # an int past 64 bits
            return None
        return tail if tail is not None and len(tail) <= LONGEST_KEY else None

    def build(self, first: int, rest: tuple[Any, ...]) -> Any:
        """The `kind` message whose fields are `first` then `rest` (as decoding builds it)."""
        return self.layout.build((first, *rest))


def keyed_shape(kind: type) -> KeyedShape:
    """The `KeyedShape` of `kind`, a message type with a binary header whose first field is
    an int followed by others."""
    binary = _binary_of.get(kind)
    if binary is None or binary[1].ints_only:
        raise TypeError(f"{kind.__qualname__} has no binary header with fields after its first")
    return KeyedShape(kind, binary[0][0], _HEAD_Q, _PREFIX + 8, binary[1])


class KeyedInbox(Inbox):
    """An `Inbox` that also receives messages of a `KeyedShape` by their key, alone in their
    frame or in a batch, once `key_with` says which. Read it with `receive_keyed` and
    `received_keyed` then (`receive_nowait` would skip what they keep)."""

    def __init__(
        self, context: zmq.Context[Any], address: str, *, max_bytes: int | None = None
    ) -> None:
        super().__init__(context, address, max_bytes=max_bytes)
        self._keys: Mapping[bytes, Any] = {}
        # the keyed shape's parts, read once per message (no frame is this long: none keyed)
        self._key_size, self._key_code, self._key_unpack = self._max_bytes + 1, -1, _HEAD_Q
        self._kept: deque[Keyed | Envelope] = deque()  # what a batch held, not yet taken

    def key_with(self, shape: KeyedShape, keys: Mapping[bytes, Any]) -> None:
        """Hand over the messages of `shape` whose key is in `keys` (kept, not copied: keys
        added later count) as (their value in `keys`, first int, payload body)."""
        self._keys = keys
        self._key_size, self._key_code, self._key_unpack = shape.size, shape.code, shape.unpack_from

    def receive_keyed(self, wait_ms: int) -> Keyed | Envelope | None:
        """`receive_nowait(wait_ms)`, except that a message keyed (`key_with`) comes back as
        a `Keyed` tuple, with no envelope. A batch's messages come one by one, its first as
        an envelope, so that a reader can tell it from a message that came alone (and take
        the others with `received_keyed`)."""
        if self._kept:
            return self._kept.popleft()
        socket, polled, self._polled = self._socket, self._polled, False
        flags = _NOBLOCK
        if wait_ms:  # one blocking receive: fewer system calls than a poll and a receive
            wait_ms = min(wait_ms, LONGEST_WAIT_MS)
            if wait_ms != self._wait_ms:  # kept in libzmq: no system call
                socket.setsockopt(zmq.RCVTIMEO, wait_ms)
                self._wait_ms = wait_ms
            flags = 0
        elif not (polled or _zmq_poll(self._poll_items, 0)):  # cheaper than raising zmq.Again
            return None
        try:
            frame = socket.recv(flags, copy=False)
            frames = [frame]
            if not frame.more:
                first = memoryview(frame)
                nbytes, size = first.nbytes, self._key_size
                if size <= nbytes <= self._max_bytes:  # `_keyed`, inlined: once per call
                    magic, length, code, number = self._key_unpack(first)
                    end = _PREFIX + length
                    if code == self._key_code and magic == MAGIC and size < end <= nbytes:
                        found = self._keys.get(bytes(first[size:end]))
                        if found is not None:
                            return found, number, first[end:]
                if first[:_BATCH] == BATCH_MAGIC:
                    self._keep_batch(first)
                    return self._kept.popleft() if self._kept else None
            while frames[-1].more:  # the parts of one message arrive together
                frames.append(socket.recv(_NOBLOCK, copy=False))
        except zmq.Again:
            return None
        except zmq.ZMQError as exc:
            raise TransportError(f"receiving on {self.address} failed: {exc}") from exc
        return self._taken(frames)

    def received_keyed(self) -> Keyed | Envelope | None:
        """The next message of a batch already received (None if none): no socket call."""
        return self._kept.popleft() if self._kept else None

    def _keyed(self, first: memoryview) -> Keyed | None:
        """The message `first` (a whole frame, or a batch's message) as a `Keyed` tuple, if
        it is one of a known key."""
        nbytes, size = first.nbytes, self._key_size
        if size <= nbytes <= self._max_bytes:
            magic, length, code, number = self._key_unpack(first)
            end = _PREFIX + length
            if code == self._key_code and magic == MAGIC and size < end <= nbytes:
                found = self._keys.get(bytes(first[size:end]))
                if found is not None:
                    return found, number, first[end:]
        return None

    def _keep_batch(self, frame: memoryview) -> None:
        """Keep the valid messages of a batch frame, those keyed as `Keyed` tuples but the
        first (see `receive_keyed`)."""
        kept, max_bytes, keyed = self._kept, self._max_bytes, self._keyed
        for message in split_batch_or_none(frame, self._log, self.address):
            found = keyed(message) if kept else None
            if found is not None:
                kept.append(found)
                continue
            try:
                kept.append(decode([message], max_bytes=max_bytes))
            except (MalformedMessage, MessageTooLarge) as exc:
                self._dropped(exc, [message])


def payload_of(body: bytes | memoryview) -> Payload:
    """The payload of a one-frame message whose body is `body` (as `decode` builds it)."""
    payload: Payload = _new(Payload)
    _set_body(payload, body)
    _set_buffers(payload, [])
    return payload


def envelope_of(header: Any, body: memoryview) -> Envelope:
    """The envelope `decode` makes of a one-frame message of `header` and `body`."""
    envelope: Envelope = _new(Envelope)
    _set_header(envelope, header)
    _set_payload(envelope, payload_of(body) if body else None)
    return envelope
