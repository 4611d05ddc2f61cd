"""`ActorHost`: the actors living in this process, each with a FIFO mailbox.

Sync endpoints run inline on the event loop when the actor is idle (the fast path); async
endpoints, and anything arriving while a handler is waiting on a nested call, run in a task.
One actor handles one message at a time, in arrival order.
"""

from __future__ import annotations

import inspect
import os
import traceback
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from supervision import SupervisionEvent, escalated, is_handled
from transport import Envelope, Payload, SerializationError, dumps, get_logger

from ._actor import EndpointDef, endpoints_of
from ._context import Context, actor_identity, enter_context, exit_context
from ._messages import ActorFailed, CallActor, Failure, Reply, SpawnActor, StopActor
from ._shape import Extent, Point

if TYPE_CHECKING:
    from ._runtime import Runtime


@dataclass(frozen=True)
class _Supervise:
    """Mailbox item (never on the wire): let the actor decide about a child's failure."""

    event: SupervisionEvent
    event_owner: str  # the owner's actor mesh id (its key in this proc)


#: How long a message for an actor that is not spawned here (yet) waits for its spawn message.
EARLY_MESSAGE_WAIT_S = 30.0


class HostedActor:
    __slots__ = (
        "actor_id",
        "busy",
        "contexts",
        "endpoints",
        "event",
        "instance",
        "mailbox",
        "mesh_id",
        "mesh_name",
        "owner",
        "point",
        "restart_count",
        "state",
    )

    def __init__(self, header: SpawnActor, point: Point) -> None:
        self.mesh_id = header.actor_id  # one actor per mesh and proc: its key here
        self.actor_id = actor_identity(header.actor_id, header.rank)
        self.mesh_name = header.mesh_name
        self.owner = header.owner
        self.point = point
        self.instance: Any = None
        self.endpoints: dict[str, EndpointDef[Any]] = {}
        self.mailbox: deque[Envelope] = deque()
        self.busy = False
        self.state = "starting"
        self.event: SupervisionEvent | None = None
        self.contexts: dict[tuple[tuple[str, ...], tuple[int, ...], int], Context] = {}
        self.restart_count = header.restart_count


class ActorHost:
    """Builds, runs and stops the actors of one process."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._actors: dict[str, HostedActor] = {}
        self._early: dict[str, list[Envelope]] = {}  # messages that beat their actor's spawn
        self._points: dict[tuple[tuple[str, ...], tuple[int, ...], int], Point] = {}
        self._injected: dict[str, tuple[str | None, BaseException]] = {}  # chaos: next call raises
        self._log = get_logger("mesh.actor")

    def deliver(self, envelope: Envelope, *, nested: bool = False) -> None:
        """Queue a message for its actor and run it now if that is safe.

        Sync handlers of an idle actor run inline, even when another actor's sync handler is
        waiting further up the stack (`nested`): a busy actor is never re-entered.
        """
        header = envelope.header
        if type(header) is SpawnActor:
            actor = HostedActor(header, self._point(header.labels, header.sizes, header.rank))
            self._actors[header.actor_id] = actor
            actor.mailbox.extend(self._early.pop(header.actor_id, ()))
            actor.mailbox.appendleft(envelope)
        elif type(header) is _Supervise:
            actor = self._actors[header.event_owner]  # type: ignore[attr-defined]
            actor.mailbox.append(envelope)
        else:
            actor = self._actors.get(header.actor_id)  # type: ignore[assignment]
            if actor is None:
                self._hold_until_spawned(envelope)
                return
            actor.mailbox.append(envelope)
        if actor.busy:
            return
        if self._needs_task(actor, actor.mailbox[0]):
            actor.busy = True
            self._runtime.start_task(self._drain_async, actor)
        else:  # also while a sync handler of another actor here waits on this one (nested)
            self._drain_inline(actor)

    def _hold_until_spawned(self, envelope: Envelope) -> None:
        """A message for an actor not built here yet: its spawn message comes from another
        sender (the owner), so it may arrive later. Wait for it, but not forever."""
        actor_id = envelope.header.actor_id
        waiting = self._early.setdefault(actor_id, [])
        waiting.append(envelope)
        if len(waiting) == 1:
            self._runtime.call_later(EARLY_MESSAGE_WAIT_S, self._give_up_waiting, actor_id)

    def _give_up_waiting(self, actor_id: str) -> None:
        for envelope in self._early.pop(actor_id, ()):
            self._reject_unknown(envelope.header)

    def supervise(self, actor_id: str, event: SupervisionEvent) -> bool:
        """Let actor `actor_id` decide about the failure of a mesh it owns; False if that
        actor does not live here (any more)."""
        actor = next((a for a in self._actors.values() if a.actor_id == actor_id), None)
        if actor is None or actor.state not in ("starting", "running"):
            return False
        envelope = Envelope(_Supervise(event, actor.mesh_id), None)
        self.deliver(envelope, nested=self._runtime.nested)
        return True

    def stop_all(self) -> None:
        for actor in self._actors.values():
            if actor.state in ("starting", "running"):
                actor.state, actor.instance = "stopped", None
                self._log.info("actor_stopped", actor_id=actor.actor_id)
                self._runtime.stop_owned_by(actor.actor_id)

    # -- running handlers -------------------------------------------------------------------

    def _needs_task(self, actor: HostedActor, envelope: Envelope) -> bool:
        header = envelope.header
        if actor.state != "running":
            return False
        if type(header) is _Supervise:
            return inspect.iscoroutinefunction(getattr(type(actor.instance), "__supervise__", None))
        if type(header) is not CallActor:
            return False
        found = actor.endpoints.get(header.endpoint)
        return found is not None and found.is_async

    def _drain_inline(self, actor: HostedActor) -> None:
        actor.busy = True
        try:
            while actor.mailbox:
                if self._needs_task(actor, actor.mailbox[0]):
                    self._runtime.start_task(self._drain_async, actor)
                    return
                self._handle(actor, actor.mailbox.popleft())
        except BaseException:
            actor.busy = False
            raise
        actor.busy = False

    async def _drain_async(self, actor: HostedActor) -> None:
        try:
            while actor.mailbox:
                envelope = actor.mailbox.popleft()
                if type(envelope.header) is _Supervise and self._needs_task(actor, envelope):
                    await self._supervise_async(actor, envelope.header.event)
                elif self._needs_task(actor, envelope):
                    await self._call_async(actor, envelope)
                else:
                    self._handle(actor, envelope)
                await anyio.lowlevel.checkpoint()
        finally:
            actor.busy = False

    def _handle(self, actor: HostedActor, envelope: Envelope) -> None:
        header = envelope.header
        if type(header) is CallActor:
            self._call_sync(actor, envelope)
        elif type(header) is SpawnActor:
            self._construct(actor, envelope)
        elif type(header) is StopActor:
            self._stop(actor, header)
        elif type(header) is _Supervise:
            self._supervise_sync(actor, header.event)

    # -- supervision of what an actor owns ---------------------------------------------------

    def _supervise_sync(self, actor: HostedActor, event: SupervisionEvent) -> None:
        if actor.state != "running":
            return
        handler = getattr(actor.instance, "__supervise__", None)
        token = enter_context(self._context(actor, actor.point))
        try:
            decision = handler(event) if handler is not None else False
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            self._escalate(actor, event, exc)
            return
        finally:
            exit_context(token)
        self._decided(actor, event, decision)

    async def _supervise_async(self, actor: HostedActor, event: SupervisionEvent) -> None:
        if actor.state != "running":
            return
        token = enter_context(self._context(actor, actor.point))
        try:
            decision = await actor.instance.__supervise__(event)
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
        own = self._event(actor, "escalated", "")
        self._fail_with(actor, escalated(child, own, error))

    def _construct(self, actor: HostedActor, envelope: Envelope) -> None:
        token = enter_context(self._context(actor, actor.point))
        try:
            cls, args, kwargs = envelope.payload.load()  # type: ignore[union-attr]
            actor.endpoints = endpoints_of(cls)
            actor.instance = cls(*args, **kwargs)
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            self._fail(actor, exc, f"the constructor of {actor.mesh_name!r} raised")
            return
        finally:
            exit_context(token)
        actor.state = "running"
        self._log.info(
            "actor_ready", actor_id=actor.actor_id, mesh=actor.mesh_name, rank=dict(actor.point)
        )

    def _call_sync(self, actor: HostedActor, envelope: Envelope) -> None:
        header: CallActor = envelope.header
        if not self._can_run(actor, header):
            return
        function = self._prepare(actor, envelope)
        if function is None:
            return
        token = enter_context(self._call_context(actor, header))
        try:
            result = function()
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            self._endpoint_raised(actor, header, exc)
            return
        finally:
            exit_context(token)
        self._reply(header, result)

    async def _call_async(self, actor: HostedActor, envelope: Envelope) -> None:
        header: CallActor = envelope.header
        if not self._can_run(actor, header):
            return
        function = self._prepare(actor, envelope)
        if function is None:
            return
        token = enter_context(self._call_context(actor, header))
        try:
            result = await function()
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:
            self._endpoint_raised(actor, header, exc)
            return
        finally:
            exit_context(token)
        self._reply(header, result)

    def _can_run(self, actor: HostedActor, header: CallActor) -> bool:
        if actor.state == "running":
            return True
        if header.reply_to is not None:
            kind = "stopped" if actor.state == "stopped" else "failed"
            event = actor.event or self._event(actor, "stopped", "by its owner")
            self._send_failure(header.reply_to, header.call_id, header.rank, kind, event)
        return False

    def _prepare(self, actor: HostedActor, envelope: Envelope) -> Any:
        """A no-argument callable for the endpoint, or None after reporting why there is none."""
        header: CallActor = envelope.header
        found = actor.endpoints.get(header.endpoint)
        if found is None and header.endpoint in _BUILTIN_ENDPOINTS:
            return self._builtin(actor, envelope)
        if self._injected and actor.actor_id in self._injected:
            injected = self._take_injected(actor, header.endpoint)
            if injected is not None:
                return lambda: _raise(injected)
        try:
            if found is None:
                raise AttributeError(
                    f"actor {actor.mesh_name!r} has no endpoint {header.endpoint!r}"
                )
            args, kwargs = envelope.payload.load()  # type: ignore[union-attr]
        except Exception as exc:
            self._endpoint_raised(actor, header, exc, fatal=False)
            return None
        method = found.function.__get__(actor.instance)
        return lambda: method(*args, **kwargs)

    def _builtin(self, actor: HostedActor, envelope: Envelope) -> Any:
        """The endpoints every actor has: ``__ping__`` (health probes: answers the pid once
        the actor runs), and for fault injection ``__fail_next__`` (the next call of an
        endpoint raises) and ``__exit_process__`` (the proc exits with a code)."""
        endpoint = envelope.header.endpoint
        if endpoint == "__ping__":
            return os.getpid
        if endpoint == "__exit_process__":
            code = envelope.payload.load()[0][0]  # type: ignore[union-attr]
            return lambda: os._exit(code)
        target, error = envelope.payload.load()[0]  # type: ignore[union-attr]
        self._injected[actor.actor_id] = (target, error)
        self._log.info("failure_injected", actor_id=actor.actor_id, endpoint=target)
        return lambda: None

    def _take_injected(self, actor: HostedActor, endpoint: str) -> BaseException | None:
        target, error = self._injected[actor.actor_id]
        if target is not None and target != endpoint:
            return None
        del self._injected[actor.actor_id]
        return error

    def _endpoint_raised(
        self, actor: HostedActor, header: CallActor, exc: BaseException, fatal: bool | None = None
    ) -> None:
        """An exception fails only the call; a broadcast's or a BaseException fails the actor."""
        if fatal is None:
            fatal = header.reply_to is None or not isinstance(exc, Exception)
        if not fatal and header.reply_to is not None:
            self._send_exception(actor, header, exc)
            return
        where = "a broadcast to" if header.reply_to is None else "a call to"
        event = self._fail(actor, exc, f"{where} endpoint {header.endpoint!r} raised")
        if header.reply_to is not None:
            self._send_failure(header.reply_to, header.call_id, header.rank, "failed", event)

    def _stop(self, actor: HostedActor, header: StopActor) -> None:
        if actor.state in ("starting", "running"):
            actor.state, actor.instance = "stopped", None
            self._log.info("actor_stopped", actor_id=actor.actor_id, mesh=actor.mesh_name)
            self._runtime.stop_owned_by(actor.actor_id)
        if header.reply_to is not None:
            self._runtime.send_message(
                header.reply_to, Reply(header.call_id, header.rank), Payload.dump(None)
            )

    def _fail(self, actor: HostedActor, exc: BaseException, what: str) -> SupervisionEvent:
        text = "".join(traceback.format_exception(exc))
        event = self._event(actor, "exception", f"{what} {type(exc).__name__}: {exc}", text)
        self._fail_with(actor, event)
        return event

    def _fail_with(self, actor: HostedActor, event: SupervisionEvent) -> None:
        """The actor is dead: what it owns is stopped first, then its owner is told."""
        actor.state, actor.instance, actor.event = "failed", None, event
        self._log.warning("actor_failed", **event.to_dict())
        self._runtime.stop_owned_by(actor.actor_id)
        self._runtime.send_message(
            actor.owner, ActorFailed(actor.mesh_id, actor.point.rank), Payload.dump(event)
        )
        for envelope in actor.mailbox:
            header = envelope.header
            if type(header) is CallActor and header.reply_to is not None:
                self._send_failure(header.reply_to, header.call_id, header.rank, "failed", event)
        actor.mailbox.clear()

    # -- replies -----------------------------------------------------------------------------

    def _reply(self, header: CallActor, result: Any) -> None:
        if header.reply_to is None:
            return
        try:
            payload = Payload.dump(result)
        except SerializationError as exc:
            actor = self._actors[header.actor_id]
            self._send_exception(actor, header, exc)
            return
        self._runtime.send_message(header.reply_to, Reply(header.call_id, header.rank), payload)

    def _send_exception(self, actor: HostedActor, header: CallActor, exc: BaseException) -> None:
        point = self._point_of(header)
        fields = {
            "exception_type": type(exc).__qualname__,
            "message": str(exc),
            "remote_traceback": "".join(traceback.format_exception(exc)),
            "mesh_name": actor.mesh_name,
            "rank": dict(actor.point),
            "call_rank": dict(point),
            "actor_id": actor.actor_id,
            "endpoint": header.endpoint,
            "host": self._runtime.hostname,
            "pid": self._runtime.pid,
        }
        detail = (fields, _pickled_or_none(exc), _pickled_or_none(type(exc)))
        self._send_failure(header.reply_to, header.call_id, header.rank, "exception", detail)

    def _send_failure(
        self, reply_to: str | None, call_id: int, rank: int, kind: str, detail: Any
    ) -> None:
        if reply_to is not None:
            self._runtime.send_message(reply_to, Failure(call_id, rank, kind), Payload.dump(detail))

    def _reject_unknown(self, header: Any) -> None:
        reply_to = getattr(header, "reply_to", None)
        if reply_to is None:
            self._log.warning("message_for_unknown_actor", actor_id=header.actor_id)
            return
        event = SupervisionEvent(
            "stopped",
            header.actor_id,
            proc_id=self._runtime.proc_id,
            host=self._runtime.hostname,
            pid=self._runtime.pid,
            message=f"earlier, or never spawned here: no actor {header.actor_id!r} arrived on "
            f"this proc within {EARLY_MESSAGE_WAIT_S:.0f} s",
        )
        self._send_failure(reply_to, header.call_id, header.rank, "stopped", event)

    # -- helpers -----------------------------------------------------------------------------

    def _point_of(self, header: CallActor) -> Point:
        return self._point(header.labels, header.sizes, header.rank)

    def _point(self, labels: tuple[str, ...], sizes: tuple[int, ...], rank: int) -> Point:
        key = (labels, sizes, rank)
        point = self._points.get(key)
        if point is None:
            point = self._points[key] = Extent(labels, sizes).point(rank)
        return point

    def _call_context(self, actor: HostedActor, header: CallActor) -> Context:
        key = (header.labels, header.sizes, header.rank)
        found = actor.contexts.get(key)
        if found is None:
            found = actor.contexts[key] = self._context(actor, self._point_of(header))
        return found

    def _context(self, actor: HostedActor, point: Point) -> Context:
        runtime = self._runtime
        return Context(
            actor.actor_id,
            actor.mesh_name,
            point,
            runtime.proc_id,
            runtime.hostname,
            runtime.pid,
            actor.restart_count,
        )

    def _event(
        self, actor: HostedActor, kind: Any, message: str, text: str | None = None
    ) -> SupervisionEvent:
        runtime = self._runtime
        return SupervisionEvent(
            kind,
            actor.mesh_name,
            rank=actor.point,
            actor_id=actor.actor_id,
            proc_id=runtime.proc_id,
            host=runtime.hostname,
            pid=runtime.pid,
            message=message,
            traceback=text,
        )


def _pickled_or_none(value: object) -> bytes | None:
    """`value` pickled in-band, or None when it cannot be (the caller then does without)."""
    try:
        body, buffers = dumps(value)
    except SerializationError:
        return None
    return None if buffers else body


_BUILTIN_ENDPOINTS = frozenset({"__ping__", "__fail_next__", "__exit_process__"})


def _raise(error: BaseException) -> None:
    raise error
