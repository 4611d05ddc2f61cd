"""`ChildFailures`: an actor decides, in ``__supervise__``, about failures of meshes it owns.

``__supervise__`` is a control signal, not a message: it runs as soon as a child fails, beside
an endpoint that is in progress (on another worker thread, or in another task when async), one
failure at a time. A falsy decision or an exception fails the actor with an escalated event.
Monarch's two-argument form, ``__supervise__(self, cx, failure)``, gets the actor's context too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import anyio

from mesh._context import context, enter_context, exit_context
from mesh._engine.host_services import HostServices
from mesh._engine.hosted_actor import HostedActor
from mesh._engine.workers import Workers
from supervision import SupervisionEvent, escalated, is_handled
from transport import get_logger

#: Fails an actor with an event: what it owns is stopped, its owner is told.
FailActor = Callable[[HostedActor, SupervisionEvent], None]


class ChildFailures:
    """Runs owners' ``__supervise__`` handlers: sync ones on a worker thread, async ones in a
    task; an actor's failures are decided in order, and only once it is built."""

    def __init__(self, services: HostServices, workers: Workers, fail: FailActor) -> None:
        self._services = services
        self._workers = workers
        self._fail = fail
        self._log = get_logger("mesh.actor")

    def decide(self, actor: HostedActor, event: SupervisionEvent) -> None:
        """Queue the failure of a mesh `actor` owns, for its ``__supervise__`` to decide."""
        with actor.lock:
            actor.to_supervise.append(event)
        self.resume(actor)

    def resume(self, actor: HostedActor) -> None:
        """Decide the queued failures, unless that is already under way or the actor is not
        built yet (its constructor finishing calls this again)."""
        with actor.lock:
            if actor.supervising or actor.state != "running" or not actor.to_supervise:
                return
            actor.supervising = True
        handler = getattr(type(actor.instance), "__supervise__", None)
        if inspect.iscoroutinefunction(handler):
            self._services.call_soon(self._services.start_task, self._decide_all_async, actor)
        else:
            self._workers.submit(self._decide_all, actor)

    def _decide_all(self, actor: HostedActor) -> None:
        """Worker thread: a sync ``__supervise__`` for each queued failure, in order."""
        while (event := self._next(actor)) is not None:
            self._decide(actor, event)

    async def _decide_all_async(self, actor: HostedActor) -> None:
        """Event loop task: an async ``__supervise__`` for each queued failure, in order."""
        while (event := self._next(actor)) is not None:
            await self._decide_async(actor, event)

    def _next(self, actor: HostedActor) -> SupervisionEvent | None:
        with actor.lock:
            if actor.to_supervise and actor.state == "running":
                return actor.to_supervise.popleft()
            if actor.state != "starting":  # failed or stopped: nobody is left to decide
                actor.to_supervise.clear()
            actor.supervising = False
            return None

    def _decide(self, actor: HostedActor, event: SupervisionEvent) -> None:
        if actor.state != "running":
            return
        handler = getattr(actor.instance, "__supervise__", None)
        token = enter_context(actor.home)
        try:
            decision = handler(*supervise_arguments(handler, event)) if handler else False
        except Exception as exc:
            self._escalate(actor, event, exc)
            return
        finally:
            exit_context(token)
        self._decided(actor, event, decision)

    async def _decide_async(self, actor: HostedActor, event: SupervisionEvent) -> None:
        if actor.state != "running":
            return
        token = enter_context(actor.home)
        try:
            handler = actor.instance.__supervise__
            decision = await handler(*supervise_arguments(handler, event))
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            self._escalate(actor, event, exc)
            return
        finally:
            exit_context(token)
        self._decided(actor, event, decision)

    def _decided(self, actor: HostedActor, event: SupervisionEvent, decision: object) -> None:
        if is_handled(decision):
            self._log.info("failure_handled", actor_id=actor.actor_id, child=str(event))
        else:
            self._escalate(actor, event, None)

    def _escalate(
        self, actor: HostedActor, child: SupervisionEvent, error: BaseException | None
    ) -> None:
        if child.is_notice:  # a warning, not a failure: the owner lives on
            self._log.warning("notice_not_handled", actor_id=actor.actor_id, child=str(child))
            return
        own = actor.make_event("escalated", "")
        self._fail(actor, escalated(child, own, error))


def supervise_arguments(handler: Callable[..., object], event: SupervisionEvent) -> tuple[Any, ...]:
    """The arguments of a bound ``__supervise__``: ``(event)``, or ``(context, event)`` for one
    that takes two (Monarch's ``__supervise__(self, cx, failure)``)."""
    try:
        parameters = inspect.signature(handler).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): the plain form
        return (event,)
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (context(), event) if len(positional) >= 2 else (event,)
