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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from ._binary import BinaryLayout
from ._errors import TransportError
from ._frames import _HEAD, _PREFIX, MAGIC, Envelope, _binary_of
from ._sockets import _NOBLOCK, LONGEST_WAIT_MS, Inbox

#: The longest key kept: headers longer than this always take the general path.
LONGEST_KEY = 512


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
    head = struct.Struct(_HEAD.format + "q")
    return KeyedShape(kind, binary[0][0], head.unpack_from, head.size, binary[1])


class KeyedInbox(Inbox):
    """An `Inbox` that also receives lone messages of a `KeyedShape` by their key."""

    def receive_keyed(
        self, wait_ms: int, shape: KeyedShape, keys: Mapping[bytes, Any]
    ) -> tuple[Any, int, memoryview] | Envelope | None:
        """`receive_nowait(wait_ms)` (-1: forever; not 0), except that a lone one-frame
        message of `shape` whose key is in `keys` comes back as (its value in `keys`, its
        first int, its payload body), with no envelope."""
        if self._split:
            return self._split.popleft()
        socket, self._polled = self._socket, False
        wait_ms = min(wait_ms, LONGEST_WAIT_MS)
        if wait_ms != self._wait_ms:  # kept in libzmq: no system call
            socket.setsockopt(zmq.RCVTIMEO, wait_ms)
            self._wait_ms = wait_ms
        try:
            frame = socket.recv(0, copy=False)
            if not frame.more:
                first, size = memoryview(frame), shape.size
                if size <= first.nbytes <= self._max_bytes:
                    magic, length, code, number = shape.unpack_from(first)
                    end = _PREFIX + length
                    if code == shape.code and magic == MAGIC and 0 < end - size <= LONGEST_KEY:
                        found = keys.get(bytes(first[size:end])) if end <= first.nbytes else None
                        if found is not None:
                            return found, number, first[end:]
            frames = [frame]
            while frames[-1].more:  # the parts of one message arrive together
                frames.append(socket.recv(_NOBLOCK, copy=False))
        except zmq.Again:
            return None
        except zmq.ZMQError as exc:
            raise TransportError(f"receiving on {self.address} failed: {exc}") from exc
        return self._taken(frames)
