"""`LoneInbox`: an inbox that hands a lone reply over as its ints and body, no objects built.

A thread blocked in a call's ``get()`` receives its reply on an inbox of its own; most often
the reply comes alone, in one frame, with a header made only of ints (`LoneShape`). Reading
those ints and the payload body straight from the frame skips the header, payload and
envelope objects and the general decoding: a third of what the waiting thread runs per call.
"""

from __future__ import annotations

from typing import Any

import zmq

from ._errors import TransportError
from ._frames import Envelope
from ._prepared import LoneShape
from ._sockets import _NOBLOCK, LONGEST_WAIT_MS, Inbox


class LoneInbox(Inbox):
    """An `Inbox` that also receives lone messages of a `LoneShape` as plain values."""

    def receive_lone(self, wait_ms: int, shape: LoneShape) -> tuple[Any, ...] | Envelope | None:
        """`receive_nowait(wait_ms)` (-1: forever; not 0), except that a lone one-frame
        message of `shape` comes back as its header's ints and its payload body (a tuple),
        with no envelope: a reply that the thread waiting for it settles at once."""
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
