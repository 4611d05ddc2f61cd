"""`Ownership`: the one registry of what this process knows and owns.

It holds the procs known here (`ProcPeer`), how each proc mesh and actor mesh spawned here was
built (`ProcMeshRecord`, `ActorMeshRecord`: enough to build any rank again, and who owns it),
and the failure handlers registered on them. Mesh handles, restarts and supervision all ask
it, so that forgetting a stopped mesh forgets it everywhere at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from mesh._engine.peers import ActorMeshView, ProcPeer
from mesh._shape import Extent
from supervision import RestartPolicy, RestartTracker, SupervisionEvent
from transport import Payload

FailureHandler = Callable[[SupervisionEvent], object]


@dataclass
class ActorMeshRecord:
    """How an actor mesh was built (enough to build any of its ranks again) and its owner."""

    actor_id: str
    name: str
    payload: Payload
    extent: Extent
    peers: tuple[ProcPeer, ...]
    owner_actor: str | None
    restarts: list[int] = field(default_factory=list)
    failed: set[int] = field(default_factory=set)
    #: The ``call_limit_s`` setting in force when it was spawned (its actors' default limit).
    call_limit_s: float | None = None
    #: On a detached proc mesh: its actors report failures to their agents, which keep them.
    detached: bool = False
    actor_class: type | None = None

    def __post_init__(self) -> None:
        self.restarts = [0] * len(self.peers)

    def view(self) -> ActorMeshView:
        return ActorMeshView(self.actor_id, self.name, self.extent, self.peers)


@dataclass
class ProcMeshRecord:
    """How a proc mesh was built, its restart policy, and the actor meshes living on it."""

    key: str
    name: str
    extent: Extent
    peers: tuple[ProcPeer, ...]
    env: tuple[tuple[str, str], ...]
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    busy_timeout_s: float
    tracker: RestartTracker | None = None
    actor_meshes: list[ActorMeshRecord] = field(default_factory=list)
    generation: int = 0
    restarting: set[int] = field(default_factory=set)
    #: The agents of the spare hosts a policy re-spawns ranks on when their host is lost
    #: (None: none given; the ranks of a lost host then escalate).
    spares: tuple[str, ...] | None = None
    #: rank -> the agent its next launch goes to (a spare, or a host named to `respawn`).
    moves: dict[int, str] = field(default_factory=dict)
    #: The command that starts each proc instead of a fork (`SpawnProcs.bootstrap`), or ().
    bootstrap: tuple[str, ...] = ()
    #: Whether its procs' lines go to this process (`ProcMesh.logging_option` was called).
    forward_output: bool = False
    #: Whether its lines go nowhere but the log files (``stream_to_client=False``).
    quiet_output: bool = False
    #: The pickled function each proc runs before it is ready (`SpawnProcs.setup`), or b"".
    setup: bytes = b""
    #: Bytes of private memory each proc may use (`SpawnProcs.memory_limit`; 0: no limit).
    memory_limit: int = 0
    #: The name it is detached under (it outlives this process), or "".
    detached: str = ""


class Ownership:
    """Procs, meshes, owners and failure handlers of one process. `lock` also guards the
    state of the peers (and the calls waiting on them)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.peers: dict[str, ProcPeer] = {}  # read-only outside this class
        self.proc_meshes: dict[str, ProcMeshRecord] = {}  # read-only outside this class
        self._mesh_of: dict[int, ProcMeshRecord] = {}  # id(peer) -> its proc mesh
        self._actor_meshes: dict[str, ActorMeshRecord] = {}
        self._handlers: dict[str, FailureHandler] = {}

    # -- procs ---------------------------------------------------------------------------------

    def add_peer(self, peer: ProcPeer) -> ProcPeer:
        with self.lock:
            self.peers[peer.proc_id] = peer
        return peer

    def peer(self, proc_id: str) -> ProcPeer | None:
        return self.peers.get(proc_id)

    def all_peers(self) -> list[ProcPeer]:
        """A snapshot of every proc known here."""
        with self.lock:
            return list(self.peers.values())

    def rekey(self, peer: ProcPeer, proc_id: str) -> None:
        """Give `peer` the id of the proc that replaces it (keeping the calls that wait)."""
        with self.lock:
            self.peers.pop(peer.proc_id, None)
            if peer.finished:
                peer.hold()
            peer.proc_id = proc_id
            self.peers[proc_id] = peer

    def drop_peers(self, peers: tuple[ProcPeer, ...]) -> None:
        """Forget these procs (stopped for good)."""
        with self.lock:
            for each in peers:
                if self.peers.get(each.proc_id) is each:
                    del self.peers[each.proc_id]

    # -- meshes --------------------------------------------------------------------------------

    def add_proc_mesh(self, record: ProcMeshRecord, policy: RestartPolicy | None) -> None:
        """Register a proc mesh spawned here, with the restart policy it runs under."""
        if policy is not None:
            record.tracker = RestartTracker(policy, len(record.peers))
        self.proc_meshes[record.key] = record
        for peer in record.peers:
            self._mesh_of[id(peer)] = record

    def add_actor_mesh(self, record: ActorMeshRecord) -> None:
        """Register an actor mesh spawned here, with the proc meshes it lives on."""
        self._actor_meshes[record.actor_id] = record
        meshes = {id(self._mesh_of.get(id(p))): self._mesh_of.get(id(p)) for p in record.peers}
        for proc_mesh in meshes.values():
            if proc_mesh is not None:
                proc_mesh.actor_meshes.append(record)

    def proc_mesh(self, key: str) -> ProcMeshRecord | None:
        return self.proc_meshes.get(key)

    def proc_mesh_of(self, peer: ProcPeer) -> ProcMeshRecord | None:
        """The record of the proc mesh `peer` belongs to, if it was spawned here."""
        return self._mesh_of.get(id(peer))

    def actor_mesh(self, actor_id: str) -> ActorMeshRecord | None:
        return self._actor_meshes.get(actor_id)

    def actor_meshes_on(self, peer: ProcPeer) -> list[ActorMeshRecord]:
        """The actor meshes spawned here that have an actor on `peer`, oldest first."""
        return [a for a in list(self._actor_meshes.values()) if any(p is peer for p in a.peers)]

    def owner_of(self, actor_id: str) -> str | None:
        """The actor that owns actor mesh `actor_id` (None: the process itself)."""
        record = self._actor_meshes.get(actor_id)
        return None if record is None else record.owner_actor

    def forget_if_stopped(self, peer: ProcPeer) -> ProcMeshRecord | None:
        """Drop `peer`'s proc mesh (its procs, the actor meshes on it, their handlers) once all
        its procs are stopped: none can fail or be re-spawned any more. Returns what went."""
        record = self._mesh_of.get(id(peer))
        if record is None or any(p.state != "stopped" for p in record.peers):
            return None
        self.proc_meshes.pop(record.key, None)
        self._handlers.pop(record.key, None)
        for each in record.peers:
            self._mesh_of.pop(id(each), None)
        for actors in record.actor_meshes:
            self._actor_meshes.pop(actors.actor_id, None)
            self._handlers.pop(actors.actor_id, None)
        self.drop_peers(record.peers)
        return record

    # -- handlers ------------------------------------------------------------------------------

    def set_handler(self, key: str, handler: FailureHandler) -> None:
        """Call `handler` for failures of the mesh `key` (a proc mesh key or actor mesh id)."""
        self._handlers[key] = handler

    def handler(self, key: str) -> FailureHandler | None:
        return self._handlers.get(key)
