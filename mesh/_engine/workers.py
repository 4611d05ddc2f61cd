"""`Workers`: the threads that run actors' sync code, so that the event loop never does.

A sync endpoint may block (``Future.get()``, I/O, a torch collective, ``asyncio.run()``); on a
worker thread it blocks only its own actor, while the event loop keeps receiving messages and
running the async endpoints of every actor in the process. Threads are long-lived and reused:
handing work to an idle one is a lock release, which keeps the call round trip short.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from transport import get_logger


class Workers:
    """A pool of daemon threads that grows to the number of tasks running at the same time."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self._held: list[Any] | None = None  # [thread id, its first task or None]
        self._counts_by_thread: dict[int, StepCount] = {}
        #: `counts.mine`: the calling thread's own `StepCount` (`Lanes` counts its calls ended).
        self.counts = _ThreadCounts(self._counts_by_thread)

    def submit(self, function: Callable[..., object], *args: Any) -> None:
        """Run `function(*args)` on an idle worker thread, or on a new one if none is idle
        (or keep it for this thread to run itself: see `hold_first`)."""
        held = self._held
        if held is not None and held[1] is None and held[0] == threading.get_ident():
            held[1] = (function, args)
            return
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker(self, f"{self._name}-{next(self._numbers)}")
        worker.start(function, args)

    def steps_of(self, ident: int) -> Callable[[], int]:
        """How many calls the thread `ident` has ended so far, read when called (a thread
        that never counted one reads 0)."""
        count = self._counts_by_thread.get(ident, StepCount())
        return lambda: count.steps

    def hold_first(self) -> None:
        """Until `take_held`, the first task this thread submits is kept for it to run itself
        (the receiver: a thread that is awake already costs no wake-up). One thread at a time."""
        self._held = [threading.get_ident(), None]

    def take_held(self) -> tuple[Callable[..., object], tuple[Any, ...]] | None:
        """The task kept since `hold_first` (None if none was submitted); submits go to
        worker threads again."""
        held, self._held = self._held, None
        return None if held is None else held[1]

    def idle_again(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)


class StepCount:
    """Calls one thread has ended (a plain attribute: adding one costs no Python call), which
    tells the receiver's watch a thread that progresses from a stuck one. Only its thread
    writes it; the watch reads it."""

    __slots__ = ("steps",)

    def __init__(self) -> None:
        self.steps = 0


class _ThreadCounts(threading.local):
    """Gives each thread its own `StepCount` (`mine`), listed by thread id for the watch."""

    def __init__(self, by_thread: dict[int, StepCount]) -> None:
        self.mine = StepCount()
        by_thread[threading.get_ident()] = self.mine


class _Worker:
    """One thread; it sleeps on `_go` (a lock held while there is nothing to do)."""

    def __init__(self, pool: Workers, name: str) -> None:
        self._pool = pool
        self._task: tuple[Callable[..., object], tuple[Any, ...]] | None = None
        self._go = threading.Lock()
        self._go.acquire()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def start(self, function: Callable[..., object], args: tuple[Any, ...]) -> None:
        self._task = (function, args)
        self._go.release()

    def _serve(self) -> None:
        _ = self._pool.counts.mine  # listed now: the watch may look at it before it counts
        while True:
            self._go.acquire()
            self._run_task()
            self._pool.idle_again(self)

    def _run_task(self) -> None:
        """Run the task; its references go with this frame, so that an idle worker keeps
        nothing alive (what only the interpreter's shutdown frees must be free to go then)."""
        assert self._task is not None
        task, self._task = self._task, None
        run_task(*task)


def run_task(function: Callable[..., object], args: tuple[Any, ...]) -> None:
    """Run a task of the pool on this thread; what escapes it is logged (a bug in meshvisor:
    tasks report their users' errors)."""
    try:
        function(*args)
    except BaseException:
        get_logger("mesh.workers").exception("worker_task_failed")
