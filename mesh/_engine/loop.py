"""`EventLoop`: the event loop of one process, which receives from its inbox and dispatches.

In the client it runs on a daemon thread, so user code on the main thread stays free; in a
proc it runs on the main thread. A `Future.get()` made on the loop thread itself (blocking code
in an async endpoint) pumps the inbox instead of blocking it (`pump_until`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio

from mesh._engine.future import LONGEST_SOCKET_WAIT_S, Future
from transport import Envelope, Inbox

_RECEIVE_BATCH = 256
#: How often a `pump_until` waiting for handed messages looks at its future anyway.
_PUMP_CHECK_S = 0.05


class InboxReader(Protocol):
    """A reader of the inbox other than the loop (a proc's `Receiver`)."""

    def start(self) -> None: ...
    def stop(self) -> None: ...


class EventLoop:
    """Runs anyio on one thread, dispatching every message of `inbox` to `dispatch`."""

    def __init__(
        self,
        inbox: Inbox,
        dispatch: Callable[[Envelope], None],
        pid: int,
        flush: Callable[[], None] = lambda: None,
    ) -> None:
        self.pid = pid
        self._inbox = inbox
        self._flush = flush  # sends the messages waiting in batches, before pumping waits
        self._dispatch = dispatch
        self._thread: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context = contextvars.Context()  # the event loop's, for call_soon
        self._wakeup: anyio.Event | None = None
        self._task_group: Any = None
        self._started = threading.Event()
        self._stopping = False
        self.finished = threading.Event()
        self._nested = 0
        self._reader: InboxReader | None = None  # None: the loop reads the inbox itself
        self._handed: deque[Envelope] = deque()  # messages the reader handed, not dispatched
        self._handed_lock = threading.Lock()
        self._unfinished = 0  # handed messages not yet dispatched to their end
        self._handed_ready = threading.Event()

    def read_with(self, reader: InboxReader) -> None:
        """Let `reader` read the inbox instead of the loop (before `run`); it hands the loop
        the messages the loop must handle (`hand`)."""
        self._reader = reader

    def run(self) -> None:
        """Run the event loop on this thread until `stop` (or `request_stop`)."""
        try:
            anyio.run(self._main)
        finally:
            self.finished.set()

    def start_in_thread(self) -> None:
        threading.Thread(target=self.run, name="meshvisor-runtime", daemon=True).start()
        self._started.wait()

    async def _main(self) -> None:
        self._thread = threading.get_ident()
        self._loop = asyncio.get_running_loop()
        self._context = contextvars.copy_context()
        self._wakeup = anyio.Event()
        async with anyio.create_task_group() as task_group:
            self._task_group = task_group
            reader = self._reader
            if reader is None:
                self._loop.add_reader(self._inbox.fileno(), self._on_readable)
            else:
                reader.start()
            self._started.set()
            if reader is None:
                self._on_readable()  # anything that arrived before the reader was installed
            await self._wakeup.wait()
            if reader is None:
                self._loop.remove_reader(self._inbox.fileno())
            else:
                reader.stop()
            task_group.cancel_scope.cancel()

    def _on_readable(self) -> None:
        """Called by the event loop whenever the inbox may have messages: dispatch them."""
        if self._nested:
            return  # a pumping Future.get() further up this thread's stack is receiving
        if not self._drain(_RECEIVE_BATCH) and not self._stopping:
            assert self._loop is not None
            self._loop.call_soon(self._on_readable)  # let other tasks run, then continue

    def _drain(self, limit: int) -> bool:
        """Dispatch up to `limit` waiting messages; True when the inbox is empty."""
        for _ in range(limit):
            envelope = self._inbox.receive_nowait()
            if envelope is None:
                return True
            self._dispatch(envelope)
        return False

    # -- messages handed by another reader of the inbox ----------------------------------------

    def hand(self, envelopes: list[Envelope]) -> None:
        """Dispatch these messages on the loop thread, in order, after those handed before
        (from the reader's thread)."""
        with self._handed_lock:
            was_empty = not self._handed
            self._handed.extend(envelopes)
            self._unfinished += len(envelopes)
        self._handed_ready.set()
        if was_empty:
            self.call_soon(self._dispatch_handed)  # in the loop's context: tasks start there

    def handing(self) -> bool:
        """Whether messages handed to the loop are not all dispatched yet."""
        return self._unfinished > 0

    def _dispatch_handed(self) -> None:
        if self._nested:
            return  # a pumping Future.get() further up this thread's stack dispatches them
        for _ in range(_RECEIVE_BATCH):
            if not self._dispatch_one_handed():
                return
        assert self._loop is not None
        self._loop.call_soon(self._dispatch_handed)  # let other tasks run, then continue

    def _dispatch_one_handed(self) -> bool:
        """Dispatch the oldest handed message; False if there was none."""
        with self._handed_lock:
            if not self._handed:
                return False
            envelope = self._handed.popleft()
        try:
            self._dispatch(envelope)
        finally:
            with self._handed_lock:
                self._unfinished -= 1
        return True

    def _pump_handed(self, future: Future[Any], deadline: float | None) -> None:
        """`pump_until` while another thread reads the inbox: dispatch what it hands over."""
        while not future.finished():
            if self._dispatch_one_handed():
                continue
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            wait = _PUMP_CHECK_S if remaining is None else min(remaining, _PUMP_CHECK_S)
            self._handed_ready.wait(wait)
            self._handed_ready.clear()
        while self._dispatch_one_handed():
            pass  # nothing left behind: the scheduled dispatch returned while nested

    def pump_until(self, future: Future[Any], timeout: float | None) -> None:
        """Receive and dispatch on this (loop) thread until `future` is done or time is up."""
        self._flush()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._nested += 1
        try:
            if self._reader is not None:
                self._pump_handed(future, deadline)
                return
            while not future.finished():
                envelope = self._inbox.receive_nowait()
                if envelope is not None:
                    self._dispatch(envelope)
                    continue
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                wait_s = None if remaining is None else min(remaining, LONGEST_SOCKET_WAIT_S)
                self._inbox.poll(None if wait_s is None else max(1, int(wait_s * 1000)))
            self._drain(1 << 30)  # leave nothing behind the edge-triggered descriptor
        finally:
            self._nested -= 1

    def run_if_idle(self, function: Callable[[], object]) -> bool:
        """Run `function` here if no other thread may be inside the inbox: this is the loop
        thread (not inside a receive, as it runs this), or the loop has finished. False
        otherwise: the loop runs it when it dispatches a `Wake` (`reader_calls.py`)."""
        if threading.get_ident() != self._thread and not self.finished.is_set():
            return False
        function()
        return True

    # -- scheduling ----------------------------------------------------------------------------

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread

    def dispatch_elsewhere(self, envelope: Envelope) -> None:
        """Hand a message received off the loop thread to the loop thread."""
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._dispatch, envelope)

    def call_soon(self, function: Callable[..., Any], *args: Any) -> None:
        """Run `function(*args)` on the loop thread soon, from any thread, in the loop's own
        context (where anyio finds its backend); a no-op once the loop has closed."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(function, *args, context=self._context)

    def call_later(self, delay_s: float, function: Callable[..., Any], *args: Any) -> None:
        """Run `function(*args)` on the loop thread after `delay_s` (loop thread only)."""
        assert self._loop is not None
        self._loop.call_later(delay_s, function, *args)

    def call_soon_threadsafe(self, function: Callable[..., Any], *args: Any) -> bool:
        """Run `function(*args)` soon on the loop thread, from any thread; False (nothing
        done) when the loop has not started or has finished: close() cleans up then."""
        loop = self._loop
        if loop is None or self.finished.is_set():
            return False
        try:
            loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the loop has just closed
            return False
        return True

    def start_task(self, function: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start a task on the event loop (loop thread only)."""
        self._task_group.start_soon(function, *args)

    def watch_fd(self, fd: int, on_readable: Callable[[], None]) -> None:
        """Call `on_readable()` on the loop thread once `fd` becomes readable (any thread)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.add_reader, fd, on_readable)

    def unwatch_fd(self, fd: int) -> None:
        """Stop watching `fd` (loop thread only)."""
        assert self._loop is not None
        self._loop.remove_reader(fd)

    # -- stopping ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the event loop to finish (from any thread) and wait for it."""
        if self._thread is None or self.finished.is_set():
            return
        if self.on_loop_thread():
            self.request_stop()
            return
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self.request_stop)
        except RuntimeError:  # the loop has already closed
            return
        self.finished.wait(5)

    def request_stop(self) -> None:
        """Finish the event loop after the current callback (loop thread only)."""
        self._stopping = True
        assert self._wakeup is not None
        self._wakeup.set()
