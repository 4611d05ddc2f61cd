"""`Cleanups`: runs an actor's ``__cleanup__(exc)`` once, when it stops or fails.

A ``def`` hook runs on a worker thread (it may block, like a sync endpoint), an ``async def``
one in a task on the event loop. A hook that raises is logged (``actor_cleanup_failed``, with
its traceback) and counts as done: a stop never waits on a hook that failed.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

from mesh._context import enter_context, exit_context
from mesh._engine.host_services import HostServices
from mesh._engine.hosted_actor import HostedActor
from mesh._engine.replying import format_traceback
from mesh._engine.workers import Workers
from transport import get_logger, safe_str

#: What runs after a cleanup, on whichever thread it ended.
Then = Callable[[], object]


class Cleanups:
    """Runs ``__cleanup__`` hooks of the actors of one proc, and knows which still run."""

    def __init__(self, services: HostServices, workers: Workers) -> None:
        self._services = services
        self._workers = workers
        self._lock = threading.Lock()
        self._running = 0
        self._when_idle: list[Then] = []
        self._log = get_logger("mesh.actor")

    def run(self, actor: HostedActor, exc: BaseException | None, then: Then | None = None) -> None:
        """Run the actor's hook (if it was built and has one, and nobody ran it yet) with
        `exc`, then call `then` (also when there is nothing to run)."""
        instance = actor.take_instance()
        hook = getattr(instance, "__cleanup__", None) if instance is not None else None
        if hook is None:
            if then is not None:
                then()
            return
        with self._lock:
            self._running += 1
        if inspect.iscoroutinefunction(hook):
            services = self._services
            services.call_soon(services.start_task, self._run_async, actor, hook, exc, then)
        else:
            self._workers.submit(self._run_sync, actor, hook, exc, then)

    def when_idle(self, then: Then) -> None:
        """Call `then` once no hook runs (now, if none does)."""
        with self._lock:
            if self._running:
                self._when_idle.append(then)
                return
        then()

    def _run_sync(self, actor: HostedActor, hook: Any, exc: Any, then: Then | None) -> None:
        token = enter_context(actor.home)
        try:
            hook(exc)
        except BaseException as error:
            self._report(actor, error)
        finally:
            exit_context(token)
            self._ended(then)

    async def _run_async(self, actor: HostedActor, hook: Any, exc: Any, then: Then | None) -> None:
        token = enter_context(actor.home)
        try:
            await hook(exc)
        except Exception as error:  # a cancellation (the proc ends) goes on up
            self._report(actor, error)
        finally:
            exit_context(token)
            self._ended(then)

    def _ended(self, then: Then | None) -> None:
        if then is not None:
            then()
        with self._lock:
            self._running -= 1
            waiting = self._when_idle if not self._running else []
            if waiting:
                self._when_idle = []
        for callback in waiting:
            callback()

    def _report(self, actor: HostedActor, error: BaseException) -> None:
        self._log.error(
            "actor_cleanup_failed",
            actor_id=actor.actor_id,
            mesh=actor.mesh_name,
            error=f"{type(error).__name__}: {safe_str(error)}",
            traceback=format_traceback(error),
        )
