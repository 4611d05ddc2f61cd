"""Lent buffers: large bytes sent straight from their owner's memory, without a copy.

By default a send copies every out-of-band buffer once, so that its sender may change the
value as soon as send() returns. A `Lent` buffer skips that copy: zmq reads the bytes from
the owner's memory while it writes them to the socket, after send() has returned. In exchange
the owner promises not to change them until `wait_released` says zmq is done with them (the
message was written out, or dropped with its connection). The transport keeps the memory alive
meanwhile (zmq holds a reference to the buffer), so dropping the owner's last reference early
is safe; changing the bytes early is not: the receiver may get some of the new ones.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import zmq

#: Smaller buffers are copied into their frame as they are pickled, which is cheaper than
#: lending them (zmq reports a lent frame done through a thread of pyzmq's), and releases them.
LEND_MIN_BYTES = 64 << 10


class Lent:
    """A contiguous buffer the transport sends from its memory; see the module's docstring.

    Pickled, it becomes one zero-copy frame per message it is sent in; unpickled on the
    receiving side, a writable memoryview of the received bytes."""

    __slots__ = ("_trackers", "view")

    def __init__(self, buffer: Any) -> None:
        view = memoryview(buffer)
        if not view.c_contiguous:
            raise ValueError(
                "only a C-contiguous buffer can be lent to the transport: make it contiguous "
                "first (a copy), or send it as a plain value"
            )
        self.view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self._trackers: list[zmq.MessageTracker] = []

    def __reduce__(self) -> tuple[Any, ...]:
        small = self.view.nbytes < LEND_MIN_BYTES  # copied at once: then it is released
        frame = zmq.Frame(self.view, copy=small, track=True)
        if not small:
            self._trackers.append(frame.tracker)
        return _received, (pickle.PickleBuffer(frame),)  # type: ignore[arg-type]

    @property
    def released(self) -> bool:
        """Whether zmq is done with every message this buffer was pickled into."""
        self._trackers = [t for t in self._trackers if not t.done]
        return not self._trackers

    def wait_released(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until `released`; whether it is."""
        deadline = time.monotonic() + timeout_s
        while not self.released:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                self._trackers[0].wait(min(left, 1.0))
            except zmq.NotDone:
                pass
        return True


def _received(buffer: Any) -> memoryview:
    return memoryview(buffer).cast("B")


def unwrap_lent(buffers: list[pickle.PickleBuffer]) -> list[Any]:
    """The out-of-band buffers of one pickling, with those of `Lent` values as their zmq
    frames: a socket sends a frame without copying it, and anything else with a copy."""
    return [_frame_of(buffer) for buffer in buffers]


def _frame_of(buffer: pickle.PickleBuffer) -> Any:
    try:
        owner: Any = buffer.raw().obj
    except BufferError:  # not contiguous: not a frame, sent with a copy as before
        return buffer
    return owner if type(owner) is zmq.Frame else buffer
