"""`Lanes`: each actor starts its messages in arrival order, each on its lane.

Sync work (the constructor, sync endpoints, built-ins, stop) runs on a worker thread, so it may
block; a call of an async endpoint runs in a task on the event loop. One lane at a time owns an
actor's mailbox: when the next message belongs to the other lane, it hands the mailbox over.
The lane runs each message to its end before the next, except a call of a concurrent endpoint:
that one it starts (on a worker thread of its own, or in a task of its own) and moves on. When
`max_concurrent` of those are in progress, or a stop is next while any is, the lane parks; the
concurrent call that ends next resumes it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from mesh._engine.host_services import HostServices
from mesh._engine.hosted_actor import HostedActor
from mesh._engine.work import Kind, Work
from mesh._engine.workers import Workers

#: Runs one piece of work of an actor: on a worker thread (sync) or in a task (async).
SyncRunner = Callable[[HostedActor, Work[Any]], None]
AsyncRunner = Callable[[HostedActor, Work[Any]], Awaitable[None]]


class Lanes:
    """Drains actors' mailboxes: on worker threads with the runner `sync_runners` has for the
    work's kind, in loop tasks with `run_async` (calls of async endpoints)."""

    def __init__(
        self,
        services: HostServices,
        workers: Workers,
        sync_runners: Mapping[Kind, SyncRunner],
        run_async: AsyncRunner,
    ) -> None:
        self._services = services
        self._workers = workers
        self._sync_runners = sync_runners
        self._run_async = run_async

    def post(self, actor: HostedActor, work: Work[Any], *, first: bool = False) -> None:
        """Queue `work` (at the front when `first`) and start draining the mailbox if no lane
        is at it already (loop thread)."""
        with actor.lock:
            if first:
                actor.mailbox.appendleft(work)
            else:
                actor.mailbox.append(work)
            if actor.busy:
                return
            actor.busy = True
            head = actor.mailbox[0]
            in_task, concurrent = actor.lane(head)
            alone = not (in_task or concurrent or actor.concurrent)
            if alone:  # `_next`'s part, done here: one lock fewer per call to an idle actor
                actor.mailbox.popleft()
        if alone:
            self._workers.submit(self._drain_sync, actor, head)
        elif in_task and self._services.on_loop_thread():
            self._services.start_task(self._drain_async, actor)
        elif in_task:  # posted by the proc's receiver thread
            self._resume(actor, in_task=True)
        else:
            self._workers.submit(self._drain_sync, actor)

    def claim_idle(self, actor: HostedActor) -> bool:
        """Whether `actor` is idle (nothing queued, running or in progress); it is then busy,
        for the caller to run one piece of its sync work through `run_alone`."""
        with actor.lock:
            if actor.busy or actor.mailbox or actor.concurrent:
                return False
            actor.busy = True
            return True

    def start_alone(self, actor: HostedActor, runner: Callable[..., None], *args: Any) -> bool:
        """Whether `actor` was idle; then `runner(*args)` runs on a worker thread (this one,
        on the proc's receiver) as `run_alone` runs it."""
        if not self.claim_idle(actor):
            return False
        self._workers.submit(self.run_alone, actor, runner, *args)
        return True

    def run_alone(self, actor: HostedActor, runner: Callable[..., None], *args: Any) -> None:
        """Worker thread: `runner(*args)`, the sync work `claim_idle` took for `actor`, then
        what was queued meanwhile, in order (as `_drain_sync`, with that work first)."""
        try:
            runner(*args)
        except BaseException:
            self._idle(actor)
            raise
        self._workers.counts.mine.steps += 1
        with actor.lock:
            if not actor.mailbox:
                actor.busy = False
                return
        self._drain_sync(actor)

    def _drain_sync(self, actor: HostedActor, work: Work[Any] | None = None) -> None:
        """Worker thread: handle the actor's messages, in order, until one is async (`work`,
        when given, is the first: `post` took it from the mailbox)."""
        count = self._workers.counts.mine  # this thread's: the watch looks at the inbox's holder
        try:
            if work is None:
                work = self._next(actor, in_task=False)
            while work is not None:
                self._sync_runners[work.kind](actor, work)
                count.steps += 1
                work = self._next(actor, in_task=False)
        except BaseException:
            self._idle(actor)
            raise

    async def _drain_async(self, actor: HostedActor) -> None:
        """Event loop task: run the actor's async calls, in order, until a message is not."""
        try:
            while (work := self._next(actor, in_task=True)) is not None:
                await self._run_async(actor, work)
                await anyio.lowlevel.checkpoint()
        except BaseException:
            self._idle(actor)
            raise

    def _next(self, actor: HostedActor, *, in_task: bool) -> Work[Any] | None:
        """The next message for the caller's lane (None when the mailbox is empty, when the
        lane parks, or after handing the mailbox over to the other lane). Calls of concurrent
        endpoints met on the way are started, not returned."""
        while True:
            with actor.lock:
                if not actor.mailbox:
                    actor.busy = False
                    return None
                head = actor.mailbox[0]
                if actor.concurrent and _must_wait(actor, head):
                    actor.parked = True
                    return None
                head_in_task, concurrent = actor.lane(head)
                if concurrent:
                    actor.concurrent += 1
                elif head_in_task != in_task:
                    break
                actor.mailbox.popleft()
            if not concurrent:
                return head
            self._start_concurrent(actor, head)
        self._resume(actor, in_task=not in_task)
        return None

    def _start_concurrent(self, actor: HostedActor, work: Work[Any]) -> None:
        """Start a concurrent call in its own task (async) or on its own worker thread."""
        if actor.runs_in_task(work):
            services = self._services
            services.call_soon(services.start_task, self._run_concurrent_async, actor, work)
        else:
            self._workers.submit(self._run_concurrent_sync, actor, work)

    def _run_concurrent_sync(self, actor: HostedActor, work: Work[Any]) -> None:
        try:
            self._sync_runners[work.kind](actor, work)
        finally:
            self._workers.counts.mine.steps += 1
            self._concurrent_ended(actor)

    async def _run_concurrent_async(self, actor: HostedActor, work: Work[Any]) -> None:
        try:
            await self._run_async(actor, work)
        finally:
            self._concurrent_ended(actor)

    def _concurrent_ended(self, actor: HostedActor) -> None:
        """A concurrent call ended: resume the lane if it waited for that."""
        with actor.lock:
            actor.concurrent -= 1
            resume = actor.parked and not (actor.mailbox and _must_wait(actor, actor.mailbox[0]))
            if resume:
                actor.parked = False
                in_task = bool(actor.mailbox) and actor.runs_in_task(actor.mailbox[0])
        if resume:
            self._resume(actor, in_task=in_task)

    def _resume(self, actor: HostedActor, *, in_task: bool) -> None:
        """Drain the (busy) actor's mailbox on the given lane."""
        if in_task:
            self._services.call_soon(self._services.start_task, self._drain_async, actor)
        else:
            self._workers.submit(self._drain_sync, actor)

    def _idle(self, actor: HostedActor) -> None:
        with actor.lock:
            actor.busy = actor.parked = False


def _must_wait(actor: HostedActor, head: Work[Any]) -> bool:
    """Whether the next message waits for concurrent calls in progress to end: a concurrent
    call beyond the actor's bound, or a stop (it comes after what was sent before it)."""
    if not actor.concurrent:
        return False
    if head.kind == "stop":
        return True
    return actor.concurrent >= actor.max_concurrent and actor.is_concurrent(head)
