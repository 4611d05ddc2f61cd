"""`Flusher`: sends an outbox's waiting batches within a bounded delay, from a thread of its own.

A batch started by a thread that goes on working (a proc answering pipelined calls, a caller
issuing them) must still leave within `delay_s`. Waking the event loop for each batch (a
self-pipe write, a timer, two loop turns) cost more GIL time than the messages themselves;
this thread instead ticks every `delay_s` while batches keep starting, flushing at each tick,
and parks (costing nothing) once a tick finds none started since the one before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ._log import get_logger


class Flusher:
    """Calls `flush` within `delay_s` of each `soon()`; one thread, started on first use."""

    def __init__(self, flush: Callable[[], None], delay_s: float, name: str) -> None:
        self._flush = flush
        self._delay_s = delay_s
        self._name = name
        self._state = threading.Condition(threading.Lock())  # guards everything below
        self._due = False  # a batch started since the last tick's flush began
        self._parked = True  # the thread waits for a `soon()` (or has not started)
        self._started = False
        self._stopped = False

    def soon(self) -> None:
        """A batch started: it must leave within `delay_s` (any thread, cheap when ticking)."""
        if self._due:  # the next tick flushes after this batch was added
            return
        with self._state:
            if self._stopped:
                return
            self._due = True
            if not self._started:
                self._started = True
                threading.Thread(target=self._run, name=self._name, daemon=True).start()
            elif self._parked:
                self._state.notify()

    def stop(self) -> None:
        """No further ticks; the owner flushes what is left (its outbox's close does)."""
        with self._state:
            self._stopped = True
            self._state.notify()

    def _run(self) -> None:
        while self._wait_until_due():
            time.sleep(self._delay_s)
            try:
                self._flush()
            except Exception:  # a closed outbox, or a bug: the thread must keep ticking
                get_logger("transport.flusher").exception("flush_failed")

    def _wait_until_due(self) -> bool:
        """Park until a batch starts; False once stopped. Clears `_due` before the tick's
        sleep, so that a batch started during it is flushed by this tick and ticks again."""
        with self._state:
            while not self._due and not self._stopped:
                self._parked = True
                self._state.wait()
                self._parked = False
            self._due = False
            return not self._stopped
