"""`Future`: the result of a call, awaited with ``get()`` in threads or ``await`` in async code."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.to_thread
import sniffio

from mesh._engine.failfast import FAIL_FAST
from mesh._engine.fork import check_not_forked
from supervision import SupervisionEvent

T = TypeVar("T")
_MAIN_THREAD = threading.main_thread().ident
_get_ident = threading.get_ident
_PENDING = object()
_callbacks_lock = threading.Lock()  # held only for a few list operations
#: The longest one wait on a socket lasts while a future's `get` waits (zmq takes up to about
#: 24 days at once): a longer timeout, infinity even, waits again.
LONGEST_SOCKET_WAIT_S = 86_400.0


class LoopPump(Protocol):
    """The event loop of the process a future was made in: on its own thread, a waiting
    ``get()`` receives and dispatches messages instead of blocking it."""

    @property
    def pid(self) -> int:
        """The process the loop runs in (a forked child must not wait on it)."""
        ...

    def on_loop_thread(self) -> bool: ...

    def pump_until(self, future: Future[Any], timeout: float | None) -> None: ...


class ReplyPump(Protocol):
    """The reply inbox of the thread that made a call: that thread receives its replies."""

    owner: int  # the ident of that thread

    def owned_by_current_thread(self) -> bool: ...

    def receive_waiting(self) -> None: ...

    def pump_until(self, future: Future[Any], timeout: float | None) -> None: ...


class Describing(Protocol):
    """What names a call in its future's messages (an endpoint), asked only when one is
    written: formatting it for every call cost two Python calls."""

    def _describe(self, adverb: str) -> str: ...


class Reaching(Protocol):
    """What a call reaches (an actor mesh): whether a failure concerns it. The future keeps
    the mesh itself, not a bound method made anew for every call."""

    def _covers(self, event: SupervisionEvent) -> bool: ...


class Future(Generic[T]):
    """A value that arrives later. ``get(timeout)`` blocks; ``await`` suspends the task.

    A timeout raises `TimeoutError` and leaves the call running: ``get`` may be called again.
    """

    #: How the call was made, for a future described by what it called (`Describing`).
    _ADVERB = "call"
    __slots__ = (
        "_callbacks",
        "_description",
        "_error",
        "_home",
        "_loop",
        "_reaches",
        "_ready",
        "_value",
    )

    def __init__(
        self,
        loop: LoopPump | None = None,
        description: str | Describing = "the call",
        home: ReplyPump | None = None,
        reaches: Reaching | None = None,
    ) -> None:
        self._loop = loop
        self._home = home
        self._reaches = reaches
        self._description = description
        self._value: Any = _PENDING
        self._error: BaseException | None = None
        # made (held) by the first `wait_briefly`: most futures are received by the thread
        # that waits on them and never need one
        self._ready: threading.Lock | None = None
        # made on the first callback: most futures never get one, and one object fewer per
        # call makes the garbage collector run less often while many calls are in flight
        self._callbacks: list[Callable[[Future[T]], None]] | None = None

    def done(self) -> bool:
        """Whether the value (or error) is there. Replies to calls made by this thread are
        received here too, so polling ``done()`` without ever calling ``get()`` works."""
        if self.finished():
            return True
        home = self._home
        if home is not None and home.owned_by_current_thread():
            home.receive_waiting()
        return self.finished()

    def finished(self) -> bool:
        """Whether the value (or error) is there, without receiving anything (internal)."""
        return self._value is not _PENDING or self._error is not None

    def get(self, timeout: float | None = None) -> T:
        """Wait for the value (at most `timeout` seconds) and return it, or raise its error."""
        error = self._error
        if error is None and self._value is _PENDING:  # `finished()`, inlined: per call
            if self._loop is not None:  # waiting in a forked child would never end
                check_not_forked(self._loop.pid)
            if _get_ident() != _MAIN_THREAD:
                self._wait(timeout)
            else:  # failures this call will raise need no interruption of the main thread
                FAIL_FAST.enter_wait(self)
                try:
                    self._wait(timeout)
                finally:
                    FAIL_FAST.exit_wait(self, self._error)
            error = self._error
        if error is not None:
            if _get_ident() == _MAIN_THREAD:  # delivered: fail-fast must not raise it a
                FAIL_FAST.raised_in_main(error)  # second time
            raise error
        return self._value  # type: ignore[no-any-return]

    def _check_process(self) -> None:
        """Waiting in a forked child of the caller would never end: raise instead."""
        if self._loop is not None:
            check_not_forked(self._loop.pid)

    def _wait(self, timeout: float | None) -> None:
        loop, home = self._loop, self._home
        if home is not None and home.owner == _get_ident():  # not the loop thread:
            home.pump_until(self, timeout)  # that one has no reply inbox of its own
        elif loop is not None and loop.on_loop_thread():
            loop.pump_until(self, timeout)
        elif home is not None:
            home.pump_until(self, timeout)
        else:
            self.wait_briefly(timeout)
        if self._value is _PENDING and self._error is None:
            raise TimeoutError(
                f"{self._text()} did not finish within {timeout} s; "
                "it is still running, call get() again to keep waiting."
            )

    def covers(self, event: SupervisionEvent) -> bool:
        """Whether `event` fails the call behind this future (so get() will raise it)."""
        return self._reaches is not None and self._reaches._covers(event)

    def wait_briefly(self, timeout: float | None) -> None:
        """Block until done or `timeout`, without receiving anything."""
        wait = -1 if timeout is None else min(max(timeout, 0), threading.TIMEOUT_MAX)
        with _callbacks_lock:
            if self.finished():
                return
            ready = self._ready
            if ready is None:
                ready = self._ready = threading.Lock()
                ready.acquire()
        if ready.acquire(timeout=wait):
            ready.release()

    def exception(self) -> BaseException | None:
        """The error this future failed with, or None (only valid once done)."""
        return self._error

    def __await__(self) -> Generator[Any, None, T]:
        if not self.finished():
            self._check_process()
            if threading.get_ident() != _MAIN_THREAD:
                yield from self._wait_async().__await__()
            else:  # as in get(): failures this call raises need no other delivery
                FAIL_FAST.enter_wait(self)
                try:
                    yield from self._wait_async().__await__()
                finally:
                    FAIL_FAST.exit_wait(self, self._error)
        return self.get(0)

    async def _wait_async(self) -> None:
        home = self._home
        if home is not None:  # made in sync code: someone must pump its thread's inbox
            while not self.finished():
                await anyio.to_thread.run_sync(home.pump_until, self, 0.1)
            return
        event = anyio.Event()
        waiter_thread = threading.get_ident()
        wake = threadsafe_caller(event.set)

        def on_done(_: Future[T]) -> None:
            if threading.get_ident() == waiter_thread:
                event.set()
            else:
                wake()

        self.add_done_callback(on_done)
        await event.wait()

    def add_done_callback(self, callback: Callable[[Future[T]], None]) -> None:
        """Call `callback(self)` once done (at once if already done), on the resolving thread."""
        with _callbacks_lock:
            if not self.finished():
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        callback(self)

    def set_result(self, value: T) -> None:
        self._finish(value, None)

    def set_exception(self, error: BaseException) -> None:
        self._finish(_PENDING, error)

    def _finish(self, value: Any, error: BaseException | None) -> None:
        with _callbacks_lock:
            if self._value is not _PENDING or self._error is not None:  # `finished()`
                return
            self._value, self._error = value, error
            callbacks, self._callbacks = self._callbacks, None
            ready = self._ready
        if ready is not None:
            ready.release()
        if callbacks is not None:
            for callback in callbacks:
                callback(self)

    def _text(self) -> str:
        """This future's description as its messages write it (see `_ADVERB`)."""
        what = self._description
        return what if isinstance(what, str) else what._describe(self._ADVERB)

    def __repr__(self) -> str:
        state = "pending" if not self.finished() else ("failed" if self._error else "done")
        return f"<Future {self._text()} {state}>"


def threadsafe_caller(action: Callable[[], object]) -> Callable[[], None]:
    """A function that runs `action` soon on the running asyncio or trio loop, from any thread
    (a no-op once that loop has closed: nobody is left to act for)."""
    library = sniffio.current_async_library()
    if library == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()
        return lambda: _ignore_closed(lambda: token.run_sync_soon(action))
    import asyncio

    loop = asyncio.get_running_loop()
    return lambda: _ignore_closed(lambda: loop.call_soon_threadsafe(action))


def _ignore_closed(schedule: Callable[[], object]) -> None:
    try:
        schedule()
    except RuntimeError:  # the loop has already closed
        pass


def resolved(value: T) -> Future[T]:
    """A future that is already done with `value`."""
    future: Future[T] = Future()
    future.set_result(value)
    return future


def any_done(futures: list[Future[Any]], what: str) -> Future[None]:
    """A future done once one of `futures` is done (at once if one is). Waiting on it receives
    the replies to the calls behind them (made by the waiting thread), so it wakes as soon as
    one of them is answered, or failed from another thread."""
    home = next((future._home for future in futures if future._home is not None), None)
    loop = next((future._loop for future in futures if future._loop is not None), None)
    done: Future[None] = Future(loop, what, home)
    for future in futures:
        future.add_done_callback(lambda _: done.set_result(None))
    return done


def all_done(futures: list[Future[Any]], loop: LoopPump | None, what: str) -> Future[None]:
    """A future done once every one of `futures` is done (whatever their outcome)."""
    done: Future[None] = Future(loop, what)
    remaining = [len(futures)]
    if not futures:
        done.set_result(None)

    def one_done(_: Future[Any]) -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            done.set_result(None)

    for future in futures:
        future.add_done_callback(one_done)
    return done
