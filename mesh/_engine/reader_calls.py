"""`ReaderCalls`: run a function (a `bind` of the inbox) where no other thread reads the inbox.

zmq sockets are not thread-safe: a `bind` on one thread while another is inside a receive on
the same socket races in libzmq. A thread that may not touch the inbox now queues the function
and sends the inbox a `Wake`; its reader runs what is queued when it dispatches that `Wake`
(between receives, at no cost to other messages), while the asking thread waits, bounded.
Any thread runs it itself when no other thread is reading the inbox (`InboxReading`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from transport import TransportError

#: The longest a thread waits for the inbox's reader to run what it asked.
READER_WAIT_S = 10.0

T = TypeVar("T")


class InboxReading(Protocol):
    """Whoever reads the inbox (the event loop, or a proc's `Receiver`)."""

    def run_if_idle(self, function: Callable[[], object]) -> bool:
        """Run `function` on this thread if no other thread is inside the inbox now (and
        none enters it meanwhile); False, not run, otherwise."""
        ...


class _Request(Generic[T]):
    """One function asked of the reader, and how it ended."""

    def __init__(self, function: Callable[[], T]) -> None:
        self.function = function
        self.done = threading.Event()
        self.taken = False  # the reader has begun it (it can no longer be withdrawn)
        self.result: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.function()
        except BaseException as exc:  # handed to the asking thread, raised there
            self.error = exc
        self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


class ReaderCalls:
    """The functions other threads asked the inbox's reader to run (see the module's doc)."""

    def __init__(self, wake: Callable[[], None], wait_s: float = READER_WAIT_S) -> None:
        self._wake = wake  # sends a `Wake` to the inbox
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._waiting: deque[_Request[Any]] = deque()
        self._closed = False

    def call(self, reading: InboxReading, function: Callable[[], T], what: str) -> T:
        """`function()`, run on this thread if no other reads the inbox, else by its reader;
        `what` (such as "listen on tcp://...") names it in the error when it cannot run."""
        request = _Request(function)
        try:
            idle = reading.run_if_idle(request.run)
        except TransportError as exc:  # the reader is stopping
            raise TransportError(f"cannot {what}: {exc}") from exc
        if not idle:
            with self._lock:
                if self._closed:
                    raise TransportError(f"cannot {what}: this process's inbox is closed.")
                self._waiting.append(request)
            self._wake()
            if not request.done.wait(self._wait_s) and not self._withdraw(request, what):
                request.done.wait(self._wait_s)  # the reader has begun it: it ends soon
        if request.error is not None:
            raise request.error
        if not request.done.is_set():
            raise TransportError(f"cannot {what}: the inbox's reader did not finish it")
        return request.result  # type: ignore[return-value]

    def run_waiting(self) -> None:
        """Run what other threads asked (the reader's thread, between two receives)."""
        while True:
            with self._lock:
                if not self._waiting:
                    return
                request = self._waiting.popleft()
                request.taken = True
            request.run()

    def close(self) -> None:
        """Fail what waits, and what is asked later: the inbox is about to close."""
        with self._lock:
            self._closed = True
            for request in self._waiting:
                request.fail(TransportError("this process's inbox closed before it was done."))
            self._waiting.clear()

    def _withdraw(self, request: _Request[T], what: str) -> bool:
        """Withdraw `request`, unless the reader has begun it (then False)."""
        with self._lock:
            if request.taken or request.done.is_set():  # begun, or failed by `close`
                return request.done.is_set()
            self._waiting.remove(request)
        request.fail(
            TransportError(
                f"cannot {what}: the thread reading this process's inbox did not get to it "
                f"within {self._wait_s:g} s (it is stuck, or the process is stopping)."
            )
        )
        return True
