"""The call watchdog: a call of an endpoint that runs past its limit is stuck.

A deadlock inside an endpoint (a lock or a queue wait, which releases the GIL) keeps the proc's
heartbeats coming, so the agent never calls it hung. Here one thread per proc, started when the
first actor with a limit is built, looks at the calls in progress a few times per (shortest)
limit; a call only notes when and where (thread, task) it started. A stuck call cannot be
cancelled safely: its actor fails with a ``"stuck"`` event whose traceback is the stack where
the call waits, and its owner stops the proc as a hung one (docs/call-watchdog.md).

A thread paused on purpose (a debugger at a breakpoint) calls `suspend_call_watchdog()` and
`resume_call_watchdog()` (or uses `call_watchdog_suspended()`): the calls it runs are not
judged meanwhile, and the time paused does not count against their limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from mesh._actor import EndpointDef, check_call_limit
from mesh._engine.messages import CallActor
from transport import get_logger

#: The watch looks this often at most, and at least every quarter of the shortest limit.
_MAX_TICK_S = 1.0
_MIN_TICK_S = 0.05


class Limit(NamedTuple):
    """How long a call of one endpoint may run, and which level set it (for the message)."""

    seconds: float
    where: str


def call_limits(
    cls: type, endpoints: Mapping[str, EndpointDef[..., Any]], spawned: float | None
) -> dict[str, Limit]:
    """The limit of each endpoint of `cls`: its own, else its class's, else `spawned` (the
    setting in force when the mesh was spawned). Endpoints without one (or with math.inf)
    are not watched, so they are left out."""
    spawned = check_call_limit(spawned, "the call_limit_s setting the actor was spawned with")
    by_class = getattr(cls, "call_limit_s", None)
    levels = (
        (by_class, f"set by {cls.__qualname__}.call_limit_s"),
        (spawned, "set by the call_limit_s setting in force when its mesh was spawned"),
    )
    limits: dict[str, Limit] = {}
    for name, found in endpoints.items():
        seconds, where = found.call_limit_s, "set on the endpoint"
        for level, named in levels:
            if seconds is None:
                seconds, where = level, named
        if seconds is not None and math.isfinite(seconds):
            limits[name] = Limit(seconds, where)
    return limits


# -- pausing the watch (a debugger) ------------------------------------------------------------

_pause_lock = threading.Lock()
_suspended: dict[int, tuple[int, float]] = {}  # thread id -> (depth of nesting, paused since)
_paused_total: dict[int, float] = {}  # thread id -> seconds it spent suspended so far


def suspend_call_watchdog() -> None:
    """Stop judging the calls this thread runs (on the event loop's thread: every call of an
    async endpoint, none of which can progress while it is held) until the matching
    `resume_call_watchdog`. Nests."""
    thread = threading.get_ident()
    with _pause_lock:
        depth, since = _suspended.get(thread, (0, time.monotonic()))
        _suspended[thread] = (depth + 1, since)


def resume_call_watchdog() -> None:
    """Undo one `suspend_call_watchdog` of this thread; after the outermost, its calls are
    judged again, the time suspended not counted. Without a suspend: a RuntimeError."""
    thread = threading.get_ident()
    with _pause_lock:
        if thread not in _suspended:
            raise RuntimeError("resume_call_watchdog() without suspend_call_watchdog() first")
        depth, since = _suspended.pop(thread)
        if depth > 1:
            _suspended[thread] = (depth - 1, since)
        else:
            _paused_total[thread] = _paused_s(thread) + time.monotonic() - since


@contextlib.contextmanager
def call_watchdog_suspended() -> Iterator[None]:
    """``with call_watchdog_suspended():`` the calls of this thread are not judged meanwhile."""
    suspend_call_watchdog()
    try:
        yield
    finally:
        resume_call_watchdog()


def _paused_s(thread: int) -> float:
    return _paused_total.get(thread, 0.0)


# -- the calls in progress ---------------------------------------------------------------------


class RunningCall:
    """A call in progress. With a `limit`, also when it started, on which thread and (for an
    async endpoint) in which task: all the watch needs, noted in well under a microsecond."""

    __slots__ = ("header", "limit", "paused_base", "started", "task", "thread")

    def __init__(self, header: CallActor, limit: Limit | None, in_task: bool) -> None:
        self.header = header
        self.limit = limit
        if limit is not None:
            self.thread = threading.get_ident()
            self.task = asyncio.current_task() if in_task else None
            self.paused_base = _paused_s(self.thread)
            self.started = time.monotonic()

    def overdue(self, now: float) -> bool:
        """Whether it has run past its limit (time its thread spent suspended not counted)."""
        if self.limit is None or self.thread in _suspended:
            return False
        paused = _paused_s(self.thread) - self.paused_base
        return now - self.started - paused > self.limit.seconds

    def describe(self) -> str:
        """Why it is stuck, in the words of a supervision event's message."""
        assert self.limit is not None
        return (
            f"endpoint {self.header.endpoint!r} was still running after {self.limit.seconds:g} "
            f"s, its limit ({self.limit.where}); a call cannot be cancelled safely, so the "
            "actor fails and its owner stops its proc, as a hung one (the traceback shows "
            "where the call waits)"
        )

    def stack(self) -> str:
        """Where the call is now: its thread's stack, or for an async endpoint waiting in an
        ``await``, its task's chain of coroutines."""
        task = self.task
        if task is not None and task is not asyncio.current_task(task.get_loop()):
            return "Stack of the task running the call (innermost last):\n" + _task_stack(task)
        frame = sys._current_frames().get(self.thread)
        if frame is None:
            return "(the thread running the call has ended)"
        lines = traceback.format_stack(frame)
        return "Stack of the thread running the call (innermost last):\n" + "".join(lines)


def _task_stack(task: asyncio.Task[Any]) -> str:
    """The frames of `task`'s coroutine and of each coroutine or generator it awaits."""
    frames = []
    awaited: Any = task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is None:
            break
        frames.append((frame, frame.f_lineno))
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return "".join(traceback.StackSummary.extract(frames).format())


# -- the watch ---------------------------------------------------------------------------------


class Watched(Protocol):
    """An actor as the watch sees it."""

    def take_overdue(self, now: float) -> RunningCall | None:
        """A call of it that ran past its limit, which it gives up (None if none did)."""
        ...


W = TypeVar("W", bound=Watched)


class CallWatch(Generic[W]):
    """The watch of one proc: a daemon thread that hands each overdue call to `on_stuck`."""

    def __init__(
        self, actors: Callable[[], Iterable[W]], on_stuck: Callable[[W, RunningCall], None]
    ) -> None:
        self._actors = actors
        self._on_stuck = on_stuck
        self._lock = threading.Lock()
        self._tick_s = _MAX_TICK_S
        self._started = False
        self._log = get_logger("mesh.callwatch")

    def watch(self, limits: Iterable[Limit]) -> None:
        """An actor with these limits was built: look often enough for them (from now on)."""
        shortest = min((limit.seconds for limit in limits), default=math.inf)
        if shortest == math.inf:
            return
        with self._lock:
            self._tick_s = min(self._tick_s, max(_MIN_TICK_S, shortest / 4))
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._run, name="meshvisor-callwatch", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self._tick_s)
            try:
                self.scan(time.monotonic())
            except Exception:  # a bug here must not end the watch
                self._log.exception("call_watch_failed")

    def scan(self, now: float) -> None:
        """Give every call overdue at `now` to `on_stuck` (one per actor: it fails)."""
        for actor in list(self._actors()):
            call = actor.take_overdue(now)
            if call is not None:
                self._on_stuck(actor, call)
