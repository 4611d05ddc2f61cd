"""`ActorHost`: the actors living in this process, each with a FIFO mailbox.

A message for an actor is classified once, when it arrives: the runtime's handler table picks
the entry for its type (`message_handlers`), which builds its `Work` and queues it in the
actor's mailbox. One actor handles one message at a time, in arrival order (`Lanes`; a call of
a concurrent endpoint only starts in that order, then overlaps what follows): its sync
code (constructor, sync endpoints, built-ins) runs on a worker thread, so it sees no running
event loop and may block, even on a call to another actor of this process; its async endpoints
run in tasks on the event loop. Both kinds of call take one path: prepare the function, run it
(only this step differs), then reply with its result or report its exception.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import anyio

from mesh._actor import endpoints_of
from mesh._context import ActorAborted, enter_context, exit_context
from mesh._engine.builtins import BUILTINS, INITIALIZED, InjectedFailures
from mesh._engine.callwatch import CallWatch, RunningCall, call_limits
from mesh._engine.cleanup import Cleanups, Then
from mesh._engine.host_services import HostServices
from mesh._engine.hosted_actor import ALIVE, HostedActor
from mesh._engine.lanes import Lanes, SyncRunner
from mesh._engine.lone_calls import LoneCalls, take_shared
from mesh._engine.messages import ActorFailed, CallActor, SpawnActor, StopActor
from mesh._engine.payload_arena import ArenaCall, ArenaMaps
from mesh._engine.proc_faults import die_if_out_of_memory
from mesh._engine.replying import Replier, clip, format_traceback
from mesh._engine.response_port import NO_REPLY, with_response_port
from mesh._engine.shared_payload import SharedCall, mapped_payload, on_shared_call
from mesh._engine.supervising import ChildFailures
from mesh._engine.work import Kind, Work, call_work, new_work
from mesh._engine.workers import Workers
from supervision import SupervisionError, SupervisionEvent
from transport import Envelope, Payload, get_logger, loads, safe_str


class ActorHost:
    """Builds, runs and stops the actors of one process."""

    def __init__(self, services: HostServices) -> None:
        self._services = services
        self._actors: dict[str, HostedActor] = {}
        self.hosted = self._actors  # read-only outside: the live view's census (census.py)
        self._early: dict[str, list[Work[Any]]] = {}  # messages that beat their actor's spawn
        self._early_lock = threading.Lock()  # messages arrive on the loop or a receiver thread
        self._injected = InjectedFailures()
        self._replier = Replier(services)
        self._arenas = ArenaMaps()  # the host agent's payload arena, mapped once
        self.workers = workers = Workers(f"meshvisor-actors-{services.proc_id}")
        sync_runners: dict[Kind, SyncRunner] = {
            "construct": self._construct,
            "call": self._call_sync,
            "builtin": self._call_sync,
            "stop": self._stop,
        }
        self._lanes = Lanes(services, workers, sync_runners, self._call_async)
        self.lone_calls = LoneCalls(
            self._actors,
            self._lanes,
            self._replier,
            self._injected,
            self._call_sync,
            self._endpoint_raised,
        )
        sync_runners["lone"] = self.lone_calls.run_queued
        self._cleanups = Cleanups(services, workers)
        self._child_failures = ChildFailures(services, workers, self._fail_with)
        stuck = functools.partial(_fail_stuck, self._replier, self._fail_with)
        self._watch = CallWatch(lambda: list(self._actors.values()), stuck)
        self._log = get_logger("mesh.actor")

    def message_handlers(self) -> dict[type, Callable[[Envelope], None]]:
        """The runtime's table entries for the messages actors take (called on the loop thread)."""
        shared, replier = on_shared_call, self._replier
        on_shared = functools.partial(take_shared, self.lone_calls, self._on_call)
        return {
            CallActor: self._on_call,
            SharedCall: functools.partial(shared, mapped_payload, on_shared, replier),
            ArenaCall: functools.partial(shared, self._arenas.payload, on_shared, replier),
            SpawnActor: self._on_spawn,
            StopActor: self._on_stop,
        }

    def _on_call(self, envelope: Envelope) -> None:
        header: CallActor = envelope.header
        actor = self._actors.get(header.actor_id)
        if actor is None or header.endpoint in BUILTINS:  # not built here yet; a built-in
            self._post(call_work(envelope))
        else:  # a user endpoint's call to a built actor: the hot path, without `_post`
            if not actor.busy:  # the next such call may come as a lone call
                self.lone_calls.learn(actor, header)
            self._lanes.post(actor, new_work(("call", header, envelope.payload, None, None)))

    def _on_spawn(self, envelope: Envelope) -> None:
        self._spawned(Work("construct", envelope.header, envelope.payload))

    def _on_stop(self, envelope: Envelope) -> None:
        self._post(Work("stop", envelope.header, envelope.payload))

    def _post(self, work: Work[Any]) -> None:
        """Queue `work` in its actor's mailbox, or hold it until the actor is built here."""
        actor = self._actors.get(work.header.actor_id)
        if actor is None:
            self._hold_until_spawned(work)
        elif work.kind == "builtin" and work.header.endpoint == INITIALIZED:
            self._answer_initialized(actor, work.header)
        else:
            self._lanes.post(actor, work)

    def _answer_initialized(self, actor: HostedActor, header: CallActor) -> None:
        """`ActorMesh.initialized`: answered as soon as the constructor has ended, without
        waiting behind the messages queued after it."""
        with actor.lock:
            if actor.state == "starting":
                actor.awaiting_init.append(header)
                return
        if actor.state == "running":
            self._replier.value(actor, header, None)
        else:
            self._refuse(actor, header)

    def _spawned(self, work: Work[SpawnActor]) -> None:
        """A new actor: its constructor runs first, then the messages that waited for it."""
        header, services = work.header, self._services
        actor = HostedActor(header, services.proc_id, services.hostname, services.pid)
        with self._early_lock:
            self._actors[header.actor_id] = actor
            actor.mailbox.extend(self._early.pop(header.actor_id, ()))
        self._lanes.post(actor, work, first=True)

    def _hold_until_spawned(self, work: Work[Any]) -> None:
        """A message for an actor not built here yet: its spawn message comes from another
        sender (the owner), so it may arrive later. Wait for it, but not forever."""
        actor_id = work.header.actor_id
        with self._early_lock:
            actor = self._actors.get(actor_id)  # spawned meanwhile, on another thread
            if actor is None:
                waiting = self._early.setdefault(actor_id, [])
                waiting.append(work)
        if actor is not None:
            self._post(work)
        elif len(waiting) == 1:
            services = self._services
            wait_s = services.settings.early_message_wait_s
            services.call_soon(services.call_later, wait_s, self._give_up_waiting, actor_id)

    def _give_up_waiting(self, actor_id: str) -> None:
        with self._early_lock:
            given_up = self._early.pop(actor_id, ())
        for work in given_up:
            self._reject_unknown(work.header)

    def _reject_unknown(self, header: CallActor | StopActor) -> None:
        if header.reply_to is None:
            self._log.warning("message_for_unknown_actor", actor_id=header.actor_id)
            return
        services = self._services
        event = SupervisionEvent(
            "stopped",
            header.actor_id,
            proc_id=services.proc_id,
            host=services.hostname,
            pid=services.pid,
            message=f"earlier, or never spawned here: no actor {header.actor_id!r} arrived on "
            f"this proc within {services.settings.early_message_wait_s:g} s",
        )
        self._replier.failure(header, "stopped", event)

    def supervise(self, actor_id: str, event: SupervisionEvent) -> bool:
        """Let actor `actor_id` decide about the failure of a mesh it owns; False if that
        actor does not live here (any more). The decision does not wait for its mailbox."""
        actor = next((a for a in self._actors.values() if a.actor_id == actor_id), None)
        if actor is None or actor.state not in ALIVE:
            return False
        self._child_failures.decide(actor, event)
        return True

    def stop_all(self, then: Then) -> None:
        """Stop every actor (the proc ends); call `then` once their cleanups have ended."""
        for actor in list(self._actors.values()):
            self._stop_actor(actor)
        self._cleanups.when_idle(then)

    def _stop_actor(self, actor: HostedActor, then: Then | None = None) -> None:
        """Stop `actor` if it is alive, and the meshes it owns with it, then clean it up."""
        if actor.stop():
            self._log.info("actor_stopped", actor_id=actor.actor_id, mesh=actor.mesh_name)
            self._services.stop_owned_by(actor.actor_id)
            self._cleanups.run(actor, None, then)
        elif then is not None:
            then()

    # -- the work of a mailbox -----------------------------------------------------------------

    def _construct(self, actor: HostedActor, work: Work[SpawnActor]) -> None:
        token = enter_context(actor.home)
        try:
            cls, args, kwargs = work.arguments()
            actor.endpoints = endpoints_of(cls)
            actor.max_concurrent = cls.max_concurrent_calls
            actor.limits = call_limits(cls, actor.endpoints, work.header.call_limit_s)
            self._watch.watch(actor.limits.values())
            actor.instance = cls(*args, **kwargs)
        except BaseException as exc:
            self._fail(actor, exc, f"the constructor of {actor.mesh_name!r} raised")
            return
        finally:
            exit_context(token)
        with actor.lock:
            actor.state = "running"
            waiting, actor.awaiting_init = actor.awaiting_init, []
        for header in waiting:
            self._replier.value(actor, header, None)
        self._log.info(
            "actor_ready", actor_id=actor.actor_id, mesh=actor.mesh_name, rank=dict(actor.point)
        )
        self._child_failures.resume(actor)  # children that failed while it was being built

    def _stop(self, actor: HostedActor, work: Work[StopActor]) -> None:
        self._stop_actor(actor, functools.partial(self._replier.stopped, actor, work.header))

    # -- calls: prepare, run (on a worker thread or in a task), then reply ---------------------

    def _call_sync(self, actor: HostedActor, work: Work[CallActor]) -> None:
        """Worker thread: a call of a sync endpoint or of a built-in (`_start_call` inline:
        this runs once per call)."""
        if actor.state != "running":
            self._refuse(actor, work.header)
            return
        function = self._prepare(actor, work)
        if function is None:
            return
        actor.start_call(work.header, False)
        token = enter_context(actor.call_context(work.header))
        try:
            result = function()
        except BaseException as exc:
            self._call_raised(actor, work.header, exc)
            return
        finally:
            exit_context(token)
        if actor.end_call(work.header) and result is not NO_REPLY:
            self._replier.value(actor, work.header, result)

    async def _call_async(self, actor: HostedActor, work: Work[CallActor]) -> None:
        """Event loop task: a call of an async endpoint (cancelled only when the proc ends)."""
        function = self._start_call(actor, work, in_task=True)
        if function is None:
            return
        token = enter_context(actor.call_context(work.header))
        try:
            result = await function()
        except anyio.get_cancelled_exc_class():
            actor.end_call(work.header)
            raise
        except BaseException as exc:
            self._call_raised(actor, work.header, exc)
            return
        finally:
            exit_context(token)
        if actor.end_call(work.header) and result is not NO_REPLY:
            self._replier.value(actor, work.header, result)

    def _start_call(
        self, actor: HostedActor, work: Work[CallActor], *, in_task: bool
    ) -> Callable[[], Any] | None:
        """The function the call runs, or None after telling the caller why it cannot run."""
        if actor.state != "running":
            self._refuse(actor, work.header)
            return None
        function = self._prepare(actor, work)
        if function is not None:
            actor.start_call(work.header, in_task)
        return function

    def _call_raised(self, actor: HostedActor, header: CallActor, exc: BaseException) -> None:
        if actor.end_call(header):
            self._endpoint_raised(actor, header, exc)

    def _refuse(self, actor: HostedActor, header: CallActor) -> None:
        """Tell the caller why the actor (not running) cannot serve its call."""
        if header.reply_to is not None:
            kind = "stopped" if actor.state == "stopped" else "failed"
            event = actor.event or actor.make_event("stopped", "by its owner")
            self._replier.failure(header, kind, event, actor)

    def _prepare(self, actor: HostedActor, work: Work[CallActor]) -> Callable[[], Any] | None:
        """A no-argument function for the call, or None after reporting why there is none.
        A failure injected for the endpoint replaces its function (never a built-in's)."""
        header, builtin = work.header, work.builtin
        if builtin is None and self._injected.pending:
            injected = self._injected.take(actor.actor_id, header.endpoint)
            if injected is not None:
                return functools.partial(_raise, injected)
        try:
            if builtin is not None:
                return builtin(work.payload, actor.actor_id, self._injected)
            found = actor.endpoints.get(header.endpoint)
            if found is None:
                raise AttributeError(
                    f"actor {actor.mesh_name!r} has no endpoint {header.endpoint!r}"
                )
            payload = work.payload  # (`arguments()` says what is wrong when there is none)
            if payload is None:
                args, kwargs = work.arguments()
            else:  # `Payload.load`, one call less
                args, kwargs = loads(payload.body, payload.buffers)
        except Exception as exc:
            self._endpoint_raised(actor, header, exc, fatal=False)
            return None
        method = found.function.__get__(actor.instance)
        if found.explicit_response_port:
            return with_response_port(self._replier, actor, header, method, (args, kwargs))
        return functools.partial(method, *args, **kwargs)

    def _endpoint_raised(
        self, actor: HostedActor, header: CallActor, exc: BaseException, fatal: bool | None = None
    ) -> None:
        """An exception fails only the call; a broadcast's or a BaseException fails the actor.
        A MemoryError at the proc's memory limit kills the proc."""
        die_if_out_of_memory(exc)
        if fatal is None:
            fatal = header.reply_to is None or not isinstance(exc, Exception)
        if not fatal and header.reply_to is not None:
            self._replier.exception(actor, header, exc)
            return
        where = "a broadcast to" if header.reply_to is None else "a call to"
        event = self._fail(actor, exc, f"{where} endpoint {header.endpoint!r} raised")
        self._replier.failure(header, "failed", event, actor)

    # -- failing -------------------------------------------------------------------------------

    def _fail(self, actor: HostedActor, exc: BaseException, what: str) -> SupervisionEvent:
        die_if_out_of_memory(exc)
        if isinstance(exc, ActorAborted):
            message = clip(f"the actor aborted itself: {safe_str(exc)}")
        else:
            message = clip(f"{what} {type(exc).__name__}: {safe_str(exc)}")
        event = actor.make_event("exception", message, clip(format_traceback(exc)))
        self._fail_with(actor, event, exc)
        return event

    def _fail_with(
        self, actor: HostedActor, event: SupervisionEvent, exc: BaseException | None = None
    ) -> None:
        """The actor is dead: what it owns is stopped first, then its owner is told, then the
        callers of the call in progress (failed by ``__supervise__``) and of those queued.
        Its ``__cleanup__`` starts first, elsewhere, with `exc` (a SupervisionError of `event`
        if None), so that a proc stop asked for by whoever is told waits for it."""
        actor.state, actor.event = "failed", event
        self._cleanups.run(actor, SupervisionError(event) if exc is None else exc)
        self._log.warning("actor_failed", **event.to_dict())
        self._services.stop_owned_by(actor.actor_id)
        self._services.send_message(
            actor.owner, ActorFailed(actor.mesh_id, actor.point.rank), Payload.dump(event)
        )
        for header in actor.take_waiting_calls():
            self._replier.failure(header, "failed", event, actor)


def _raise(error: BaseException) -> None:
    raise error


def _fail_stuck(
    replier: Replier,
    fail_with: Callable[[HostedActor, SupervisionEvent], None],
    actor: HostedActor,
    call: RunningCall,
) -> None:
    """The call watch's thread: `call` ran past its limit and `actor` gave it up. Its caller
    and its owner hear a "stuck" event with the stack where it waits."""
    event = actor.make_event("stuck", call.describe(), clip(call.stack()))
    replier.failure(call.header, "failed", event, actor)
    fail_with(actor, event)
