"""`HostedActor`: one actor living in this proc: its instance, state, mailbox and contexts."""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from typing import Any

from mesh._actor import DEFAULT_MAX_CONCURRENT_CALLS, EndpointDef
from mesh._context import Context, actor_identity
from mesh._engine.callwatch import Limit, RunningCall
from mesh._engine.messages import CallActor, SpawnActor
from mesh._engine.work import CALL_KINDS, Work
from mesh._shape import Extent, Point
from supervision import SupervisionEvent

#: The states in which an actor still has a future: it is being built, or it runs.
ALIVE = ("starting", "running")


class HostedActor:
    """The state of one actor. `lock` guards the mailbox, `busy`, `parked`, `running`,
    `concurrent`, `awaiting_init` and the queue of child failures, which the event loop, worker
    threads and tasks all touch."""

    __slots__ = (
        "actor_id",
        "awaiting_init",
        "busy",
        "concurrent",
        "contexts",
        "endpoints",
        "event",
        "home",
        "instance",
        "limits",
        "lock",
        "mailbox",
        "max_concurrent",
        "mesh_id",
        "mesh_name",
        "owner",
        "parked",
        "running",
        "state",
        "supervising",
        "to_supervise",
    )

    def __init__(self, header: SpawnActor, proc_id: str, host: str, pid: int) -> None:
        self.mesh_id = header.actor_id  # one actor per mesh and proc: its key here
        self.actor_id = actor_identity(header.actor_id, header.rank)
        self.mesh_name = header.mesh_name
        self.owner = header.owner
        point = Extent(header.labels, header.sizes).point(header.rank)
        #: Its context at its point in the mesh it was spawned in (constructor, supervision).
        self.home = Context(
            self.actor_id, self.mesh_name, point, proc_id, host, pid, header.restart_count
        )
        self.instance: Any = None
        self.endpoints: dict[str, EndpointDef[..., Any]] = {}
        self.mailbox: deque[Work[Any]] = deque()
        self.busy = False  # a worker thread or a task is handling the mailbox
        self.parked = False  # busy, but the next message waits for concurrent calls to end
        self.lock = threading.Lock()
        self.running: list[RunningCall] = []  # the calls in progress (ordinary, concurrent)
        self.limits: dict[str, Limit] = {}  # the call watchdog's limits, by endpoint
        self.concurrent = 0  # how many calls of concurrent endpoints are in progress
        self.max_concurrent = DEFAULT_MAX_CONCURRENT_CALLS
        self.awaiting_init: list[CallActor] = []  # `initialized` calls made while it is built
        self.to_supervise: deque[SupervisionEvent] = deque()
        self.supervising = False
        self.state = "starting"
        self.event: SupervisionEvent | None = None  # why it failed
        self.contexts: dict[tuple[tuple[str, ...], tuple[int, ...], int], Context] = {}

    @property
    def point(self) -> Point:
        return self.home.rank

    def runs_in_task(self, work: Work[Any]) -> bool:
        """Whether `work` runs in a task on the event loop (a call of an async endpoint of a
        built actor) rather than on a worker thread."""
        if work.kind != "call" or self.state != "running":
            return False
        found = self.endpoints.get(work.header.endpoint)
        return found is not None and found.is_async

    def is_concurrent(self, work: Work[Any]) -> bool:
        """Whether `work` is a call of a concurrent endpoint of a built actor."""
        if work.kind != "call" or self.state != "running":
            return False
        found = self.endpoints.get(work.header.endpoint)
        return found is not None and found.concurrent

    def lane(self, work: Work[Any]) -> tuple[bool, bool]:
        """(`runs_in_task`, `is_concurrent`) of `work` in one call: a mailbox's drain asks
        both of each message."""
        if work.kind != "call" or self.state != "running":
            return _ON_THREAD
        found = self.endpoints.get(work.header.endpoint)
        if found is None:
            return _ON_THREAD
        return found.is_async, found.concurrent

    def call_context(self, header: CallActor) -> Context:
        """Its context for a call: its point in the mesh (or slice) the call was sent to."""
        key = (header.labels, header.sizes, header.rank)
        found = self.contexts.get(key)
        if found is None:
            point = Extent(header.labels, header.sizes).point(header.rank)
            found = self.contexts[key] = dataclasses.replace(self.home, rank=point)
        return found

    def stop(self) -> bool:
        """Mark it stopped; False if it was no longer alive (stopped or failed before)."""
        if self.state not in ALIVE:
            return False
        self.state = "stopped"
        return True

    def take_instance(self) -> Any:
        """The instance, which it no longer holds (None if another caller took it first):
        whoever takes it runs its ``__cleanup__``, so that runs once."""
        with self.lock:
            instance, self.instance = self.instance, None
        return instance

    def start_call(self, header: CallActor, in_task: bool) -> None:
        """A call starts, on this thread (in this task if `in_task`)."""
        call = RunningCall(header, self.limits.get(header.endpoint), in_task)
        with self.lock:
            self.running.append(call)

    def take_overdue(self, now: float) -> RunningCall | None:
        """A call that ran past its limit at `now`, given up (its end answers no one) and the
        actor marked failed; None if none did, or if the actor is no longer running."""
        with self.lock:
            if self.state != "running":
                return None
            for index, call in enumerate(self.running):
                if call.overdue(now):
                    del self.running[index]
                    self.state = "failed"
                    return call
        return None

    def end_call(self, header: CallActor) -> bool:
        """The endpoint returned or raised: whether its caller still waits for the outcome
        (not when the actor failed meanwhile: failing it answered the call already)."""
        with self.lock:
            for index, running in enumerate(self.running):
                if running.header is header:
                    del self.running[index]
                    return True
        return False

    def take_waiting_calls(self) -> list[CallActor]:
        """The calls in progress and those queued, which no one will run now that it failed."""
        with self.lock:
            waiting = [call.header for call in self.running] + self.awaiting_init
            waiting += [work.header for work in self.mailbox if work.kind in CALL_KINDS]
            self.running, self.awaiting_init = [], []
            self.mailbox.clear()
        return waiting

    def make_event(self, kind: Any, message: str, traceback: str | None = None) -> SupervisionEvent:
        """A supervision event about this actor."""
        home = self.home
        return SupervisionEvent(
            kind,
            self.mesh_name,
            rank=home.rank,
            actor_id=self.actor_id,
            proc_id=home.proc_id,
            host=home.host,
            pid=home.pid,
            message=message,
            traceback=traceback,
        )


_ON_THREAD = (False, False)  # (`HostedActor.lane`: runs on a worker thread, not concurrent)
