"""Fail-fast at the root: an unhandled failure is raised in the client's main thread.

If the main thread is blocked in ``Future.get()`` (or awaits a future) on a call that the
failure also fails, that call raises it. Otherwise, if async code opened a ``supervised()``
scope, the newest open scope is cancelled and raises it at its exit. Otherwise a real-time
signal interrupts the main thread wherever it is (a sleep, a busy loop, a blocking wait), like
KeyboardInterrupt but with the right type, so ``try/except SupervisionError`` around any block
catches it. Uncaught, it ends the program with status 1 after printing the supervision report;
atexit handlers run and stop every owned proc. In a Jupyter kernel (or any IPython shell) a
`MainThreadGate` keeps the signal out of the kernel's own code: see `mesh/_engine/notebook.py`.
"""

from __future__ import annotations

import asyncio
import ctypes
import signal
import sys
import threading
from collections import deque
from types import FrameType, TracebackType
from typing import Any, Protocol

from supervision import ActorError, SupervisionError, SupervisionEvent
from transport import serializing_now


class Awaited(Protocol):
    """A future the main thread waits on: whether its call raises a given failure itself."""

    def covers(self, event: SupervisionEvent) -> bool: ...


class FailureScope(Protocol):
    """A region of async code that takes unhandled failures instead of the main thread."""

    def fail(self, events: list[SupervisionEvent]) -> bool:
        """Take `events` to raise at the scope's exit; False once the scope is closed."""
        ...


class MainThreadGate(Protocol):
    """Where the main thread may be interrupted, when it also runs someone else's loop (an
    IPython kernel between cells): raising there would end that program."""

    def may_interrupt(self) -> bool:
        """Whether to signal the main thread now (a cell runs); else what is owed waits."""
        ...

    def may_raise(self, frame: FrameType | None) -> bool:
        """Whether an error raised at `frame` (the signal's) reaches the user's code."""
        ...


#: The signal used to interrupt the main thread (a real-time one nobody else uses by default).
FAIL_FAST_SIGNAL = signal.SIGRTMIN + 7
#: Events already raised in the main thread, so that a late duplicate is not raised again.
_DELIVERED_MEMORY = 1024
#: How many other failures of the same incident the report lists (one line each).
_RELATED_SHOWN = 5
#: How often the main thread is signalled again while a failure is still owed to it.
_RESIGNAL_S = 0.05


class FailFast:
    """Delivers unhandled supervision events to the client's main thread, each exactly once."""

    def __init__(self) -> None:
        self._undelivered: deque[SupervisionEvent] = deque()
        self._lock = threading.Lock()
        self._main = threading.main_thread()
        self._waiting: list[Awaited] = []  # futures the main thread is blocked on
        self._scopes: list[FailureScope] = []  # open supervised() scopes, newest last
        self._installed = False
        self._signal_scheduled = False
        self._delivered: deque[SupervisionEvent] = deque(maxlen=_DELIVERED_MEMORY)
        self._gate: MainThreadGate | None = None

    def install(self) -> None:
        """Take over the signal and the excepthook (main thread only; idempotent)."""
        if self._installed or threading.current_thread() is not self._main:
            return
        if signal.getsignal(FAIL_FAST_SIGNAL) in (signal.SIG_DFL, None):
            signal.signal(FAIL_FAST_SIGNAL, self._on_signal)
        previous = sys.excepthook
        sys.excepthook = lambda *info: _print_report(previous, *info)
        self._installed = True

    def set_gate(self, gate: MainThreadGate | None) -> None:
        """Interrupt the main thread only where `gate` allows (None: anywhere)."""
        self._gate = gate

    def deliver_pending(self) -> None:
        """Raise what is owed now, in the calling (main) thread: where the gate held it back."""
        if self._undelivered and not self._waiting and not self._hand_to_scope():
            self._deliver()

    def raise_in_main(self, event: SupervisionEvent) -> None:
        """Queue `event` and interrupt the main thread once the current event loop iteration
        is over, so that the failures of one incident are delivered together."""
        with self._lock:
            if event in self._delivered:
                return  # a call already raised it to the main thread
            self._undelivered.append(event)
            if self._signal_scheduled:
                return
            self._signal_scheduled = True
        try:
            asyncio.get_running_loop().call_soon(self._interrupt_main)
        except RuntimeError:
            self._interrupt_main()

    def _interrupt_main(self) -> None:
        with self._lock:
            self._signal_scheduled = False
        if not self._owed() or self._hand_to_scope():
            return
        if self._gate is not None and not self._gate.may_interrupt():
            return  # held for the gate's next chance (`deliver_pending`)
        if signal.getsignal(FAIL_FAST_SIGNAL) == self._on_signal:
            try:
                signal.pthread_kill(self._main.ident, FAIL_FAST_SIGNAL)  # type: ignore[arg-type]
            except (ProcessLookupError, OSError):
                return  # the main thread has finished
            # A signal that lands just before the main thread enters a blocking call (sleep,
            # poll) runs its handler only when that call returns: signal again until delivered.
            try:
                asyncio.get_running_loop().call_later(_RESIGNAL_S, self._interrupt_main)
            except RuntimeError:
                pass
        elif self._gate is None:  # no handler of ours: raise at the next bytecode instead
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self._main.ident or 0), ctypes.py_object(_PendingFailure)
            )

    def _owed(self) -> bool:
        """Whether some queued event is not going to be raised by a call being waited on."""
        with self._lock:
            waiting = list(self._waiting)
            return any(not any(f.covers(e) for f in waiting) for e in self._undelivered)

    def open_scope(self, scope: FailureScope) -> None:
        with self._lock:
            self._scopes.append(scope)

    def close_scope(self, scope: FailureScope) -> None:
        with self._lock:
            self._scopes.remove(scope)

    def _hand_to_scope(self) -> bool:
        """Give what is owed to the newest open scope that takes it; False if none did."""
        with self._lock:
            waiting = list(self._waiting)
            owed = [e for e in self._undelivered if not any(f.covers(e) for f in waiting)]
            if not owed:
                return bool(self._scopes)
            for scope in reversed(self._scopes):
                if scope.fail(owed):
                    self._undelivered = deque(e for e in self._undelivered if e not in owed)
                    self._delivered.extend(owed)
                    return True
        return False

    def enter_wait(self, future: Awaited) -> None:
        self._waiting.append(future)

    def exit_wait(self, future: Awaited, error: BaseException | None) -> None:
        """The main thread stopped waiting on `future`; deliver what is still owed."""
        self._waiting.remove(future)
        if isinstance(error, SupervisionError) and not isinstance(error, ActorError):
            # get() raises it: what is owed goes along
            with self._lock:
                owed = [e for e in self._undelivered if e != error.event]
                self._undelivered.clear()
                self._delivered.extend([error.event, *owed])
            error.related_events = tuple(owed)
        elif self._undelivered and not self._waiting and not self._hand_to_scope():
            self._deliver()

    def raised_in_main(self, error: BaseException) -> None:
        """A call's get() raised `error` in the main thread: that delivered its failure."""
        if not isinstance(error, SupervisionError):
            return
        with self._lock:
            if error.event in self._delivered:
                return
            self._delivered.append(error.event)
            if error.event in self._undelivered:
                self._undelivered.remove(error.event)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if serializing_now():  # raised now, it would turn into a SerializationError of the
            return  # value being pickled: the next signal (every _RESIGNAL_S) delivers it
        if self._gate is not None and not self._gate.may_raise(frame):
            return  # not in the user's code: the next signal, or the gate, delivers it
        self._deliver(blocking=False)

    def _deliver(self, blocking: bool = True) -> None:
        """Raise the oldest owed event; failures queued with it (one agent loss fails many
        ranks at once) travel along as `related_events`, so one except clause catches all.
        The signal handler does not block: it may have interrupted the main thread while that
        thread holds the lock (waiting would never end); the next signal delivers instead."""
        if not self._lock.acquire(blocking=blocking):
            return
        try:
            if all(any(f.covers(e) for f in self._waiting) for e in self._undelivered):
                return  # the call being waited on will raise them
            owed = sorted(self._undelivered, key=lambda e: any(f.covers(e) for f in self._waiting))
            self._undelivered.clear()
            self._delivered.extend(owed)
        finally:
            self._lock.release()
        error = SupervisionError(owed[0])
        error.related_events = tuple(owed[1:])
        raise error

    def take_pending(self) -> SupervisionEvent | None:
        with self._lock:
            return self._undelivered.popleft() if self._undelivered else None


class _PendingFailure(SupervisionError):
    """Raised asynchronously when the signal handler could not be installed."""

    def __init__(self) -> None:
        event = FAIL_FAST.take_pending() or SupervisionEvent(
            "escalated", "unknown", message="an unhandled failure was reported"
        )
        super().__init__(event)


def _print_report(
    previous: Any, kind: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    previous(kind, value, tb)
    if isinstance(value, SupervisionError):
        print("\n" + value.event.report(), file=sys.stderr)
        related = value.related_events
        if related:
            shown = [f"  - {event}" for event in related[:_RELATED_SHOWN]]
            more = len(related) - len(shown)
            shown += [f"  ... and {more} more (SupervisionError.related_events)"] if more else []
            heading = f"\nAlso failed in the same incident ({len(related)}):"
            print("\n".join([heading, *shown]), file=sys.stderr)


FAIL_FAST = FailFast()
