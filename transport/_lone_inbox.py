"""`LoneInbox`: an inbox that hands a lone reply over as its ints and body, no objects built.

A thread blocked in a call's ``get()`` receives its reply on an inbox of its own; most often
the reply comes alone, in one frame, with a header made only of ints (`LoneShape`). Reading
those ints and the payload body straight from the frame skips the header, payload and
envelope objects and the general decoding: a third of what the waiting thread runs per call.
Replies that arrive together in a batch frame (pipelined calls) are read the same way, each.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import zmq

from ._batches import _PREFIX, _U32, BATCH_MAGIC
from ._errors import MalformedMessage, MessageTooLarge, TransportError
from ._frames import Envelope, Payload, decode
from ._prepared import LoneShape
from ._sockets import _NOBLOCK, LONGEST_WAIT_MS, Inbox, _zmq_poll

_MAGIC_BYTES = len(BATCH_MAGIC)
#: What a lone inbox hands over: a lone message's ints and body, or any other message.
Received = tuple[Any, ...] | Envelope


class LoneInbox(Inbox):
    """An `Inbox` that also receives lone messages of a `LoneShape` as plain values: from
    `receive_lone`, and from `receive_nowait` and `receive_received` for the messages of a
    batch frame (their callers take both)."""

    def __init__(
        self,
        context: zmq.Context[Any],
        address: str,
        shape: LoneShape,
        *,
        max_bytes: int | None = None,
    ) -> None:
        super().__init__(context, address, max_bytes=max_bytes)
        self._shape = shape
        self._split: deque[Any] = deque()  # a batch's messages: `Received` each

    def receive_nowait(self, wait_ms: int = 0) -> Envelope | None:
        """As `Inbox.receive_nowait`: a lone message of a batch is made an envelope again."""
        return self._enveloped(super().receive_nowait(wait_ms))

    def receive_received(self) -> Envelope | None:
        """As `Inbox.receive_received`: a lone message is made an envelope again."""
        return self._enveloped(self._split.popleft() if self._split else None)

    def received_lone(self) -> Received | None:
        """The next message of a batch already received, as `receive_lone` hands it over
        (None if none): no socket call."""
        taken: Received | None = self._split.popleft() if self._split else None
        return taken

    def receive_lone(self, wait_ms: int) -> Received | None:
        """`receive_nowait(wait_ms)` (-1: forever; not 0), except that a lone one-frame
        message of this inbox's shape comes back as its header's ints and its payload body
        (a tuple), with no envelope: a reply that the thread waiting for it settles at once."""
        if self._split:
            taken: Received = self._split.popleft()
            return taken
        socket, self._polled = self._socket, False
        wait_ms = min(wait_ms, LONGEST_WAIT_MS)
        if wait_ms != self._wait_ms:  # kept in libzmq: no system call
            socket.setsockopt(zmq.RCVTIMEO, wait_ms)
            self._wait_ms = wait_ms
        try:
            frame = socket.recv(0, copy=False)
            if not frame.more:
                first, shape = memoryview(frame), self._shape
                size = shape.size
                if size <= first.nbytes <= self._max_bytes:
                    head = shape.unpack_from(first)
                    if head[0] == shape.lead:
                        return (*head[1:], first[size:])
            frames = [frame]
            while frames[-1].more:  # the parts of one message arrive together
                frames.append(socket.recv(_NOBLOCK, copy=False))
        except zmq.Again:
            return None
        except zmq.ZMQError as exc:
            raise TransportError(f"receiving on {self.address} failed: {exc}") from exc
        return self._taken(frames)

    def receive_lone_nowait(self) -> Received | None:
        """`receive_nowait()`, except that a lone one-frame message of this inbox's shape
        comes back as its header's ints and its payload body (a tuple), as from
        `receive_lone`: for a reader that takes both and never waits here (a host agent
        reading its procs' answers)."""
        if self._split:
            taken: Received = self._split.popleft()
            return taken
        socket, polled, self._polled = self._socket, self._polled, False
        shape = self._shape
        while polled or _zmq_poll(self._poll_items, 0):  # cheaper than raising zmq.Again
            polled = False
            try:
                frame = socket.recv(_NOBLOCK, copy=False)
                frames = [frame]
                while frames[-1].more:  # the parts of one message arrive together
                    frames.append(socket.recv(_NOBLOCK, copy=False))
            except zmq.Again:
                return None
            except zmq.ZMQError as exc:
                raise TransportError(f"receiving on {self.address} failed: {exc}") from exc
            if len(frames) == 1:
                first = memoryview(frame)
                if shape.size <= first.nbytes <= self._max_bytes:
                    head = shape.unpack_from(first)
                    if head[0] == shape.lead:
                        return (*head[1:], first[shape.size :])
            got: Received | None = self._taken(frames)
            if got is not None:
                return got
        return None

    def _take_batch(self, frame: memoryview) -> None:
        """Keep the messages of a batch frame to be taken one by one: a lone message of this
        inbox's shape as its ints and body (as `receive_lone` reads one), any other decoded
        (the invalid ones dropped, logged; a malformed batch dropped whole)."""
        try:
            messages = self._split_lone(frame)
        except MalformedMessage as exc:
            self._log.warning("message_dropped", address=self.address, reason=str(exc), frames=1)
            return
        split, max_bytes = self._split, self._max_bytes
        for message in messages:
            if type(message) is tuple:
                split.append(message)
                continue
            try:
                split.append(decode([message], max_bytes=max_bytes))
            except (MalformedMessage, MessageTooLarge) as exc:
                self._dropped(exc, [message])

    def _split_lone(self, frame: memoryview) -> list[Any]:
        """`split_batch`, with each lone message of this inbox's shape read as it goes (its
        ints and body, a tuple); the others as their slices of `frame`."""
        end, shape, max_bytes = frame.nbytes, self._shape, self._max_bytes
        size, lead, unpack_from = shape.size, shape.lead, shape.unpack_from
        if end < _PREFIX:
            raise MalformedMessage("a truncated batch: it ends before its message count")
        (count,) = _U32.unpack_from(frame, _MAGIC_BYTES)
        if count > (end - _PREFIX) // _U32.size:
            raise MalformedMessage(
                f"a batch declares {count} messages, more than its size can hold"
            )
        messages: list[Any] = []
        position = _PREFIX
        for _ in range(count):
            if position + _U32.size > end:
                raise MalformedMessage("a truncated batch: a message length runs past its end")
            (length,) = _U32.unpack_from(frame, position)
            position += _U32.size
            stop = position + length
            if stop > end:
                raise MalformedMessage(
                    f"a batch message declares {length} bytes, more than the {end - position} left"
                )
            if size <= length <= max_bytes and (head := unpack_from(frame, position))[0] == lead:
                messages.append((*head[1:], frame[position + size : stop]))
            else:
                messages.append(frame[position:stop])
            position = stop
        if position != end:
            raise MalformedMessage(f"a batch has {end - position} bytes after its last message")
        return messages

    def _enveloped(self, got: Received | None) -> Envelope | None:
        """`got` as an envelope (a lone message's header built from its ints)."""
        if not isinstance(got, tuple):
            return got
        body = got[-1]
        payload = Payload(body) if body.nbytes else None
        return Envelope(self._shape.kind(*got[:-1]), payload)
