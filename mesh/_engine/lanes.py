"""`Lanes`: each actor handles its messages one at a time, in arrival order, each on its lane.

Sync work (the constructor, sync endpoints, built-ins, stop) runs on a worker thread, so it may
block; a call of an async endpoint runs in a task on the event loop. One lane at a time owns an
actor's mailbox: when the next message belongs to the other lane, it hands the mailbox over.
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
            in_task = actor.runs_in_task(actor.mailbox[0])
        if in_task:
            self._services.start_task(self._drain_async, actor)
        else:
            self._workers.submit(self._drain_sync, actor)

    def _drain_sync(self, actor: HostedActor) -> None:
        """Worker thread: handle the actor's messages, in order, until one is async."""
        try:
            while (work := self._next(actor, in_task=False)) is not None:
                self._sync_runners[work.kind](actor, work)
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
        """The next message for the caller's lane (None when the mailbox is empty, or after
        handing the mailbox over to the other lane)."""
        with actor.lock:
            if not actor.mailbox:
                actor.busy = False
                return None
            if actor.runs_in_task(actor.mailbox[0]) == in_task:
                return actor.mailbox.popleft()
        if in_task:
            self._workers.submit(self._drain_sync, actor)
        else:
            self._services.call_soon(self._services.start_task, self._drain_async, actor)
        return None

    def _idle(self, actor: HostedActor) -> None:
        with actor.lock:
            actor.busy = False
