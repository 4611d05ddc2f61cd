"""`ProcPeer`: a proc as one process sees it: where it listens and whether it is alive, and
the `Route` of the messages to each of its actors.

`ActorMeshView`: an actor mesh as one process sees it, to tell of its actors' failures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mesh._context import actor_identity
from mesh._engine.future import Future
from mesh._shape import Extent, Point
from supervision import EventKind, SupervisionEvent


class Route:
    """The path of the messages this process sends to one actor (straight to its proc, or
    through its host agent): `sent` messages so far, the first `seen` known to have arrived."""

    __slots__ = ("seen", "sent", "via_agent")

    def __init__(self) -> None:
        self.via_agent = False
        self.sent = 0
        self.seen = 0

    @property
    def settled(self) -> bool:
        """Whether every message sent on this path arrived: the next may take another."""
        return self.seen == self.sent


class ProcPeer:
    """State of one remote (or local) proc. Messages wait here until its address is known."""

    __slots__ = (
        "address",
        "agent",
        "calls",
        "event",
        "gone",
        "host",
        "mesh_key",
        "mesh_name",
        "owned",
        "owner_actor",
        "pid",
        "point",
        "proc_id",
        "queued",
        "ready",
        "routes",
        "state",
    )

    def __init__(
        self,
        proc_id: str,
        mesh_name: str,
        point: Point,
        agent: str | None,
        address: str | None = None,
        *,
        mesh_key: str = "",
        owned: bool = False,
        owner_actor: str | None = None,
    ) -> None:
        self.proc_id = proc_id
        self.mesh_name = mesh_name
        self.mesh_key = mesh_key
        self.owned = owned
        self.owner_actor = owner_actor
        self.point = point
        self.agent = agent
        self.address = address
        self.pid: int | None = None
        self.host: str | None = None
        self.state = "ready" if address else "starting"
        self.event: SupervisionEvent | None = None
        self.queued: list[list[Any]] = []
        self.calls: set[int] = set()
        self.routes: dict[str, Route] = {}  # by actor id: the path of this process's messages
        self.ready: Future[None] = Future(description=f"the start of proc {proc_id}")
        self.gone: Future[None] = Future(description=f"the end of proc {proc_id}")
        if address:
            self.ready.set_result(None)

    def hold(self) -> None:
        """Start over as a proc being (re)started: calls queue here until it is ready."""
        self.state, self.address, self.pid, self.event = "starting", None, None, None
        self.routes = {}
        self.ready = Future(description=f"the start of proc {self.proc_id}")
        self.gone = Future(description=f"the end of proc {self.proc_id}")

    @property
    def location(self) -> str | None:
        """Where this proc is reached: its address, or its host agent's until it is ready
        (what `Runtime.address_for` needs to know of it)."""
        return self.address or self.agent

    @property
    def alive(self) -> bool:
        return self.state in ("starting", "ready")

    @property
    def finished(self) -> bool:
        return self.state in ("failed", "stopped")

    def make_event(self, kind: EventKind, message: str = "", **fields: Any) -> SupervisionEvent:
        """An event about this proc (what it is known by here), with `fields` on top."""
        known = {"pid": self.pid, "host": self.host} | fields
        return SupervisionEvent(
            kind, self.mesh_name, rank=self.point, proc_id=self.proc_id, message=message, **known
        )

    def stopped_event(self, why: str) -> SupervisionEvent:
        """The event of this proc being stopped on purpose, `why` being e.g. "by its owner"."""
        return self.make_event("stopped", why)

    def __repr__(self) -> str:
        return f"<ProcPeer {self.proc_id} {self.state} {self.address}>"


@dataclass(frozen=True, eq=False)
class ActorMeshView:
    """An actor mesh: its id, name, full extent and the proc each rank runs on."""

    mesh_id: str
    name: str
    extent: Extent
    peers: tuple[ProcPeer, ...]

    def proc_failed(self, peer: ProcPeer, event: SupervisionEvent) -> SupervisionEvent:
        """`event` (about `peer`'s proc) as told about the actor of this mesh on that proc: it
        names this mesh and the actor; proc, pid and host still say which process ended."""
        rank = next((r for r, p in enumerate(self.peers) if p is peer), None)
        if rank is None:
            return event
        return dataclasses.replace(
            event,
            mesh_name=self.name,
            rank=self.extent.point(rank),
            actor_id=actor_identity(self.mesh_id, rank),
        )
