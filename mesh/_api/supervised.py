"""`supervised()`: a region of async client code where unhandled failures are raised.

Neither asyncio nor trio can throw an arbitrary exception into a suspended task, so async
code marks the region that should receive failures, the way ``anyio.fail_after`` marks the
region a timeout applies to: an unhandled failure cancels the region (at its current await)
and is raised as `SupervisionError` where it ends, so a ``try/except SupervisionError`` around
it catches it, and catching it handles it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

import anyio

from mesh._engine.failfast import FAIL_FAST
from mesh._engine.future import threadsafe_caller
from supervision import SupervisionError, SupervisionEvent


class supervised:
    """Raise unhandled supervision failures that happen inside this ``async with`` block.

    Works in asyncio and trio (through anyio). While several scopes are open, the newest one
    receives a failure. A failure of a call awaited inside the block is raised by that await,
    as usual; the scope only adds the failures nobody waits on. A block that never awaits
    sees the failure when it ends.
    """

    def __init__(self) -> None:
        self._cancel_scope = anyio.CancelScope()
        self._lock = threading.Lock()
        self._events: list[SupervisionEvent] = []
        self._open = False
        self._cancel_soon: Callable[[], None] = lambda: None

    async def __aenter__(self) -> supervised:
        if self._open or self._cancel_scope.cancel_called:
            raise RuntimeError("a supervised() scope can be entered only once; make a new one.")
        self._cancel_soon = threadsafe_caller(self._cancel_scope.cancel)
        self._cancel_scope.__enter__()
        self._open = True
        FAIL_FAST.open_scope(self)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        FAIL_FAST.close_scope(self)
        with self._lock:
            self._open = False
            events = self._events
        swallowed = self._cancel_scope.__exit__(kind, error, tb)
        if events:
            failure = SupervisionError(events[0])
            failure.related_events = tuple(events[1:])
            raise failure
        return bool(swallowed)

    def fail(self, events: list[SupervisionEvent]) -> bool:
        """Take `events` and cancel the block (from any thread); False once it has ended."""
        with self._lock:
            if not self._open:
                return False
            self._events.extend(events)
        self._cancel_soon()
        return True

    @property
    def failed(self) -> bool:
        """Whether a failure was delivered to this scope."""
        return bool(self._events)
