"""`ActorHost`: the actors living in this process, each with a FIFO mailbox.

One actor handles one message at a time, in arrival order. Its sync code (constructor, sync
endpoints) runs on a worker thread, so it sees no running event loop and may block, even on a
call to another actor of this process; its async endpoints run in tasks on the event loop.
``__supervise__`` is a control signal, not a message: it runs as soon as a child fails, beside
an endpoint that is in progress (on another worker thread, or in another task when async), one
failure at a time.
"""

from __future__ import annotations

import inspect
import os
import threading
import traceback
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import anyio

from mesh._actor import EndpointDef, endpoints_of
from mesh._context import Context, actor_identity, enter_context, exit_context
from mesh._engine.messages import ActorFailed, CallActor, Failure, Reply, SpawnActor, StopActor
from mesh._engine.workers import Workers
from mesh._shape import Extent, Point
from supervision import SupervisionEvent, escalated, is_handled
from transport import (
    Envelope,
    MessageTooLarge,
    Payload,
    SerializationError,
    TransportError,
    dumps,
    encode,
    get_logger,
    safe_str,
)

if TYPE_CHECKING:
    from mesh._engine.runtime import Runtime

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
        "lock",
        "mailbox",
        "mesh_id",
        "mesh_name",
        "owner",
        "point",
        "restart_count",
        "running",
        "state",
        "supervising",
        "to_supervise",
    )

    def __init__(self, header: SpawnActor, point: Point) -> None:
        self.mesh_id = header.actor_id  # one actor per mesh and proc: its key here
        self.actor_id = actor_identity(header.actor_id, header.rank)
        self.mesh_name = header.mesh_name
        self.owner = header.owner
        self.point = point
        self.instance: Any = None
        self.endpoints: dict[str, EndpointDef[..., Any]] = {}
        self.mailbox: deque[Envelope] = deque()
        self.busy = False  # a worker thread or a task is handling the mailbox
        self.lock = threading.Lock()  # guards mailbox, busy, running and the supervision queue
        self.running: CallActor | None = None  # the call in progress, if any
        self.to_supervise: deque[SupervisionEvent] = deque()
        self.supervising = False
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
        self._workers = Workers(f"meshvisor-actors-{runtime.proc_id}")
        self._log = get_logger("mesh.actor")

    def deliver(self, envelope: Envelope) -> None:
        """Queue a message for its actor, and start handling its mailbox if it is idle
        (loop thread)."""
        header = envelope.header
        if type(header) is SpawnActor:
            actor = HostedActor(header, self._point(header.labels, header.sizes, header.rank))
            self._actors[header.actor_id] = actor
            actor.mailbox.extend(self._early.pop(header.actor_id, ()))
            actor.mailbox.appendleft(envelope)
        else:
            found = self._actors.get(header.actor_id)
            if found is None:
                self._hold_until_spawned(envelope)
                return
            actor = found
        with actor.lock:
            if type(header) is not SpawnActor:
                actor.mailbox.append(envelope)
            if actor.busy:
                return
            actor.busy = True
            needs_task = self._needs_task(actor, actor.mailbox[0])
        if needs_task:
            self._runtime.start_task(self._drain_async, actor)
        else:
            self._workers.submit(self._drain_sync, actor)

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
        actor does not live here (any more). The decision does not wait for its mailbox."""
        actor = next((a for a in self._actors.values() if a.actor_id == actor_id), None)
        if actor is None or actor.state not in ("starting", "running"):
            return False
        with actor.lock:
            actor.to_supervise.append(event)
        self._start_supervising(actor)
        return True

    def _start_supervising(self, actor: HostedActor) -> None:
        """Run `__supervise__` for the queued failures, unless that is already under way or
        the actor is not built yet (its constructor finishing starts it then)."""
        with actor.lock:
            if actor.supervising or actor.state != "running" or not actor.to_supervise:
                return
            actor.supervising = True
        handler = getattr(type(actor.instance), "__supervise__", None)
        if inspect.iscoroutinefunction(handler):
            self._runtime.call_soon(self._runtime.start_task, self._supervise_all_async, actor)
        else:
            self._workers.submit(self._supervise_all, actor)

    def stop_all(self) -> None:
        for actor in self._actors.values():
            if actor.state in ("starting", "running"):
                actor.state, actor.instance = "stopped", None
                self._log.info("actor_stopped", actor_id=actor.actor_id)
                self._runtime.stop_owned_by(actor.actor_id)

    # -- running handlers -------------------------------------------------------------------

    def _needs_task(self, actor: HostedActor, envelope: Envelope) -> bool:
        """Whether `envelope` is a call of an async endpoint (run in a task on the loop)."""
        header = envelope.header
        if actor.state != "running" or type(header) is not CallActor:
            return False
        found = actor.endpoints.get(header.endpoint)
        return found is not None and found.is_async

    def _drain_sync(self, actor: HostedActor) -> None:
        """Worker thread: handle the actor's messages, in order, until one is async."""
        try:
            while (envelope := self._next_message(actor, is_async=False)) is not None:
                self._handle(actor, envelope)
        except BaseException:
            self._idle(actor)
            raise

    async def _drain_async(self, actor: HostedActor) -> None:
        """Event loop task: run the actor's async calls, in order, until a message is not."""
        try:
            while (envelope := self._next_message(actor, is_async=True)) is not None:
                await self._call_async(actor, envelope)
                await anyio.lowlevel.checkpoint()
        except BaseException:
            self._idle(actor)
            raise

    def _next_message(self, actor: HostedActor, *, is_async: bool) -> Envelope | None:
        """The next message for the caller's kind of lane (None when the mailbox is empty, or
        after handing the mailbox over to the other kind of lane)."""
        with actor.lock:
            if not actor.mailbox:
                actor.busy = False
                return None
            if self._needs_task(actor, actor.mailbox[0]) == is_async:
                return actor.mailbox.popleft()
        if is_async:
            self._workers.submit(self._drain_sync, actor)
        else:
            self._runtime.call_soon(self._runtime.start_task, self._drain_async, actor)
        return None

    def _idle(self, actor: HostedActor) -> None:
        with actor.lock:
            actor.busy = False

    def _handle(self, actor: HostedActor, envelope: Envelope) -> None:
        header = envelope.header
        if type(header) is CallActor:
            self._call_sync(actor, envelope)
        elif type(header) is SpawnActor:
            self._construct(actor, envelope)
        elif type(header) is StopActor:
            self._stop(actor, header)

    # -- supervision of what an actor owns ---------------------------------------------------

    def _supervise_all(self, actor: HostedActor) -> None:
        """Worker thread: a sync ``__supervise__`` for each queued failure, in order."""
        while (event := self._next_failure(actor)) is not None:
            self._supervise_sync(actor, event)

    async def _supervise_all_async(self, actor: HostedActor) -> None:
        """Event loop task: an async ``__supervise__`` for each queued failure, in order."""
        while (event := self._next_failure(actor)) is not None:
            await self._supervise_async(actor, event)

    def _next_failure(self, actor: HostedActor) -> SupervisionEvent | None:
        with actor.lock:
            if actor.to_supervise and actor.state == "running":
                return actor.to_supervise.popleft()
            if actor.state != "starting":  # failed or stopped: nobody is left to decide
                actor.to_supervise.clear()
            actor.supervising = False
            return None

    def _supervise_sync(self, actor: HostedActor, event: SupervisionEvent) -> None:
        if actor.state != "running":
            return
        handler = getattr(actor.instance, "__supervise__", None)
        token = enter_context(self._context(actor, actor.point))
        try:
            decision = handler(event) if handler is not None else False
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
        except BaseException as exc:
            self._fail(actor, exc, f"the constructor of {actor.mesh_name!r} raised")
            return
        finally:
            exit_context(token)
        actor.state = "running"
        self._log.info(
            "actor_ready", actor_id=actor.actor_id, mesh=actor.mesh_name, rank=dict(actor.point)
        )
        self._start_supervising(actor)  # children that failed while it was being built

    def _call_sync(self, actor: HostedActor, envelope: Envelope) -> None:
        header: CallActor = envelope.header
        if not self._can_run(actor, header):
            return
        function = self._prepare(actor, envelope)
        if function is None:
            return
        token = enter_context(self._call_context(actor, header))
        actor.running = header
        try:
            result = function()
        except BaseException as exc:
            if self._call_ended(actor, header):
                self._endpoint_raised(actor, header, exc)
            return
        finally:
            exit_context(token)
        if self._call_ended(actor, header):
            self._reply(header, result)

    async def _call_async(self, actor: HostedActor, envelope: Envelope) -> None:
        header: CallActor = envelope.header
        if not self._can_run(actor, header):
            return
        function = self._prepare(actor, envelope)
        if function is None:
            return
        token = enter_context(self._call_context(actor, header))
        actor.running = header
        try:
            result = await function()
        except anyio.get_cancelled_exc_class():
            self._call_ended(actor, header)
            raise
        except BaseException as exc:
            if self._call_ended(actor, header):
                self._endpoint_raised(actor, header, exc)
            return
        finally:
            exit_context(token)
        if self._call_ended(actor, header):
            self._reply(header, result)

    def _call_ended(self, actor: HostedActor, header: CallActor) -> bool:
        """The endpoint returned or raised: whether its caller still waits for the outcome
        (not when the actor failed meanwhile: failing it answered the call already)."""
        with actor.lock:
            ours = actor.running is header
            actor.running = None
        return ours

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
        message = _clip(f"{what} {type(exc).__name__}: {safe_str(exc)}")
        event = self._event(actor, "exception", message, _clip(_safe_traceback(exc)))
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
        with actor.lock:  # the call in progress (failed by __supervise__), then those queued
            waiting = [actor.running] if actor.running is not None else []
            waiting += [envelope.header for envelope in actor.mailbox]
            actor.running = None
            actor.mailbox.clear()
        for header in waiting:
            if type(header) is CallActor and header.reply_to is not None:
                self._send_failure(header.reply_to, header.call_id, header.rank, "failed", event)

    # -- replies -----------------------------------------------------------------------------

    def _reply(self, header: CallActor, result: Any) -> None:
        """Send the result; one that cannot be sent (unpicklable, too large) fails the call."""
        if header.reply_to is None:
            return
        error = self._send_value(header.reply_to, Reply(header.call_id, header.rank), result)
        if error is not None:
            actor = self._actors[header.actor_id]
            self._send_exception(actor, header, _unsendable_result(header, error))

    def _send_value(self, reply_to: str, header: Any, value: Any) -> Exception | None:
        """Send `value` with `header`, or return why it cannot go (serialization, size)."""
        try:
            frames = encode(header, Payload.dump(value))
        except Exception as exc:  # whatever pickling raises must not lose the call
            return exc
        self._runtime.send_frames(reply_to, header, frames)
        return None

    def _send_exception(self, actor: HostedActor, header: CallActor, exc: BaseException) -> None:
        """Tell the caller its call raised `exc`: the exception itself where it can travel,
        else a description that surely can (an error that cannot be sent must not hang it)."""
        fields = self._exception_fields(actor, header, exc)
        failure = Failure(header.call_id, header.rank, "exception")
        assert header.reply_to is not None
        error: Exception | None = None
        for detail in _exception_details(fields, exc):
            error = self._send_value(header.reply_to, failure, detail)
            if error is None:
                return
        self._log.error(
            "reply_lost", actor_id=actor.actor_id, call_id=header.call_id, reason=safe_str(error)
        )

    def _exception_fields(
        self, actor: HostedActor, header: CallActor, exc: BaseException
    ) -> dict[str, Any]:
        return {
            "exception_type": type(exc).__qualname__,
            "message": safe_str(exc),
            "remote_traceback": _safe_traceback(exc),
            "mesh_name": actor.mesh_name,
            "rank": dict(actor.point),
            "call_rank": dict(self._point_of(header)),
            "actor_id": actor.actor_id,
            "endpoint": header.endpoint,
            "host": self._runtime.hostname,
            "pid": self._runtime.pid,
        }

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
    except Exception:
        return None
    return None if buffers else body


def _exception_details(fields: dict[str, Any], exc: BaseException) -> Iterator[tuple[Any, ...]]:
    """What a caller is told of `exc`, from everything to what surely fits in a message."""
    exception_class = _pickled_or_none(type(exc))
    yield fields, _pickled_or_none(exc), exception_class
    clipped = {
        **fields,
        "message": _clip(fields["message"]),
        "remote_traceback": _clip(fields["remote_traceback"]),
    }
    yield clipped, None, exception_class
    yield clipped, None, None


def _unsendable_result(header: CallActor, error: Exception) -> TransportError:
    """The error a caller gets for a result that could not be sent back; it keeps the
    transport's error type (SerializationError, MessageTooLarge), so it can be caught as such."""
    where = f"the result of endpoint {header.endpoint!r}"
    wrapped: TransportError
    if isinstance(error, MessageTooLarge):
        wrapped = MessageTooLarge(f"{where} could not be sent back: {safe_str(error)}")
    elif isinstance(error, SerializationError):
        wrapped = SerializationError(f"{where} could not be serialized: {safe_str(error)}")
    else:
        why = f"{type(error).__name__}: {safe_str(error)}"
        wrapped = SerializationError(f"{where} could not be serialized: {why}")
    wrapped.__cause__ = error
    return wrapped


def _safe_traceback(exc: BaseException) -> str:
    """The formatted traceback of `exc`, or why it could not be formatted."""
    try:
        return "".join(traceback.format_exception(exc))
    except Exception as error:
        return f"<the traceback could not be formatted: {type(error).__name__}>"


#: The longest message or traceback text sent when the full one does not fit.
_CLIP_CHARS = 8000


def _clip(text: str) -> str:
    """`text`, or its beginning and end when it is longer than `_CLIP_CHARS`."""
    if len(text) <= _CLIP_CHARS:
        return text
    half = _CLIP_CHARS // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters left out ...]\n{text[-half:]}"


_BUILTIN_ENDPOINTS = frozenset({"__ping__", "__fail_next__", "__exit_process__"})


def _raise(error: BaseException) -> None:
    raise error
