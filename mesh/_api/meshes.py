"""Mesh handles: `HostMesh` → `ProcMesh` → `ActorMesh`, all sliceable like arrays."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, Generic, TypeVar

from mesh._actor import check_actor_class, reserve_endpoint_names, resolve_endpoint
from mesh._api.endpoint import EndpointRef
from mesh._context import actor_identity, context
from mesh._engine.calls import GatherSink, ResultSink
from mesh._engine.future import Future, all_done, resolved
from mesh._engine.messages import (
    CallActor,
    ShutdownAgent,
    SpawnActor,
    StopActor,
    WatchProcs,
)
from mesh._engine.peers import ActorMeshView, ProcPeer
from mesh._engine.replies import ReplyInbox
from mesh._engine.restarts import ActorMeshRecord, ProcMeshRecord
from mesh._engine.runtime import Runtime
from mesh._engine.session import current_session
from mesh._engine.supervisor import FailureHandler
from mesh._shape import Extent, Region
from supervision import RestartPolicy, SupervisionError, SupervisionEvent
from transport import Payload, check_fd_headroom

A = TypeVar("A")
M = TypeVar("M", bound="MeshBase")
DEFAULT_STOP_GRACE_S = 5.0
#: File descriptors one proc costs the process that owns and calls it (connections both
#: ways, more while it starts), an upper bound measured on Linux.
FDS_PER_PROC = 9
#: The longest mesh name spawn_procs and spawn accept.
MAX_NAME_LEN = 255


def check_name(what: str, name: object) -> None:
    """Refuse a mesh name that is not a short, printable string without '/'."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {what} needs a non-empty name (a str), got {name!r}")
    if len(name) > MAX_NAME_LEN:
        raise ValueError(
            f"the {what} name {name[:40]!r}... is {len(name)} characters long; "
            f"use at most {MAX_NAME_LEN}"
        )
    if "/" in name or not name.isprintable():
        raise ValueError(
            f"the {what} name {name!r} contains '/' or a control character; use a name without them"
        )


def _file_safe(name: str) -> str:
    """A short prefix for proc ids (which name socket files) that reads like `name`."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:20].lstrip(".-") or "procs"


class MeshBase:
    """What every mesh shares: an extent and array-like slicing."""

    _region: Region

    def _with_region(self: M, region: Region) -> M:
        raise NotImplementedError

    @property
    def extent(self) -> Extent:
        return self._region.extent

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self._region.extent)

    def size(self, dim: str | Iterable[str] | None = None) -> int:
        """Number of points along `dim` (a label or several), or in the whole mesh."""
        if dim is None:
            return len(self._region)
        labels = [dim] if isinstance(dim, str) else list(dim)
        total = 1
        for label in labels:
            if label not in self.extent.labels:
                raise ValueError(
                    f"mesh has no dimension {label!r}; its dimensions are "
                    f"{list(self.extent.labels)}"
                )
            total *= self.extent[label]
        return total

    def __len__(self) -> int:
        return len(self._region)

    def slice(self: M, **selection: int | slice) -> M:
        """A sub-mesh: an int drops that dimension, a slice keeps it."""
        return self._with_region(self._region.slice(**selection))

    def flatten(self: M, name: str) -> M:
        """The same points along a single dimension called `name`."""
        return self._with_region(self._region.flatten(name))

    def rename(self: M, **names: str) -> M:
        """The same mesh with dimensions renamed, ``old=new``."""
        return self._with_region(self._region.rename(**names))


class HostMesh(MeshBase):
    """Hosts, each served by a host agent; spawns procs on them."""

    def __init__(self, agents: tuple[str, ...], region: Region) -> None:
        self._agents = agents
        self._region = region

    def _with_region(self, region: Region) -> HostMesh:
        return HostMesh(self._agents, region)

    def spawn_procs(
        self,
        per_host: Mapping[str, int] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        name: str = "procs",
        heartbeat_interval_s: float | None = None,
        heartbeat_timeout_s: float | None = None,
        busy_timeout_s: float | None = None,
        restart: RestartPolicy | None = None,
    ) -> ProcMesh:
        """One new OS process per point of each host times ``per_host``; returns at once.

        A proc that sends no heartbeat for `heartbeat_timeout_s` and makes no progress
        (stopped, or blocked) is killed and reported as hung; one that keeps using CPU time
        meanwhile (a long C call holding the GIL, an overloaded machine) gets up to
        `busy_timeout_s`. With a `restart` policy, failed ranks are re-spawned on their agents
        (with their actors) instead of escalating, within its limits.
        """
        interval, timeout, busy = current_session().runtime.settings.heartbeats(
            heartbeat_interval_s, heartbeat_timeout_s, busy_timeout_s
        )
        check_name("proc mesh", name)
        per_host = dict(per_host or {})
        overlap = set(per_host) & set(self.extent.labels)
        if overlap:
            raise ValueError(
                f"per_host dimensions {sorted(overlap)} clash with the host mesh's "
                f"dimensions {list(self.extent.labels)}"
            )
        extent = Extent(
            self.extent.labels + tuple(per_host), self.extent.sizes + tuple(per_host.values())
        )
        if env is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise TypeError("env must map str to str")
        for key, value in (env or {}).items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise ValueError(
                    f"env variable {key[:40]!r} cannot be set: names must be non-empty without "
                    "'=' or NUL, and values without NUL"
                )
        runtime = current_session().runtime
        _check_fds_for_procs(runtime, extent.nelements)
        key = f"{_file_safe(name)}-{secrets.token_hex(3)}"
        owner_actor = context().actor_id
        peers = tuple(
            runtime.add_peer(
                ProcPeer(
                    f"{key}-{rank}",
                    name,
                    point,
                    self._agents[self._region.ranks[rank // (extent.nelements // len(self))]],
                    mesh_key=key,
                    owned=True,
                    owner_actor=owner_actor,
                )
            )
            for rank, point in enumerate(extent.points())
        )
        record = ProcMeshRecord(
            key, name, extent, peers, tuple((env or {}).items()), interval, timeout, busy
        )
        runtime.restarts.add_proc_mesh(record, restart)
        runtime.restarts.launch(record, list(range(len(peers))))
        return ProcMesh(runtime, name, Region.full(extent), peers)

    def _agent_addresses(self) -> list[str]:
        """The address of each host agent of this (sliced) mesh."""
        return sorted({self._agents[base] for base in self._region.ranks})

    def shutdown(self) -> Future[None]:
        """Stop the host agents of this mesh, and with them every proc they run (for an
        attached allocation: the daemons themselves)."""
        session = current_session()
        agents = {self._agents[base] for base in self._region.ranks}
        if session.is_client and session.local_agent in agents:
            session.shutdown_local_agent()
        for agent in agents - {session.local_agent}:
            session.runtime.agent_stopping(agent)
            session.runtime.send_message(agent, ShutdownAgent(DEFAULT_STOP_GRACE_S))
        return resolved(None)

    def __repr__(self) -> str:
        return f"<HostMesh {self.sizes}>"


class _Stoppable:
    """`async with` / `with` support: leaving the block stops the mesh."""

    def stop(self) -> Future[None]:
        raise NotImplementedError

    def __enter__(self: A) -> A:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop().get()

    async def __aenter__(self: A) -> A:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


class ProcMesh(MeshBase, _Stoppable):
    """OS processes, one per point; actors are spawned onto them."""

    def __init__(
        self, runtime: Runtime, name: str, region: Region, peers: tuple[ProcPeer, ...]
    ) -> None:
        self._runtime = runtime
        self.name = name
        self._region = region
        self._peers = peers

    def _with_region(self, region: Region) -> ProcMesh:
        return ProcMesh(self._runtime, self.name, region, self._peers)

    def spawn(self, name: str, actor_class: type[A], *args: Any, **kwargs: Any) -> ActorMesh[A]:
        """One `actor_class(*args, **kwargs)` per proc; returns at once, calls wait for it."""
        check_actor_class(actor_class)
        check_name("actor mesh", name)
        payload = Payload.dump((actor_class, args, kwargs))
        actor_id = f"{name}-{secrets.token_hex(4)}"
        extent = self.extent
        peers = tuple(self._peers[base] for base in self._region.ranks)
        messages = [
            (
                peer,
                SpawnActor(
                    actor_id, self._runtime.address, name, extent.labels, extent.sizes, rank
                ),
            )
            for rank, peer in enumerate(peers)
        ]
        supervisor = self._runtime.supervisor
        supervisor.actor_mesh_owners[actor_id] = context().actor_id
        for peer in peers:
            supervisor.actor_meshes_on.setdefault(peer.proc_id, []).append(actor_id)
        self._runtime.restarts.add_actor_mesh(
            ActorMeshRecord(actor_id, name, payload, extent, peers, context().actor_id)
        )
        self._runtime.send_to_procs(messages, payload, None)
        state = _ActorMeshState(name, actor_id, actor_class, peers, extent)
        return ActorMesh(self._runtime, state, Region.full(extent))

    def respawn(self) -> Future[None]:
        """Re-spawn the failed procs of this mesh (and rebuild failed actors) on the agents
        they ran on: same name, points and constructor arguments; healthy ranks untouched.
        The future is done when the new procs are up; calls made meanwhile wait for them."""
        record = self._runtime.restarts.proc_meshes.get(self._peers[0].mesh_key)
        if record is None and all(peer.state == "stopped" for peer in self._peers):
            return resolved(None)  # stopped on purpose: nothing failed, nothing to re-spawn
        if record is None:
            raise ValueError(
                f"proc mesh {self.name!r} was not spawned by this process, so it "
                "cannot re-spawn it; ask its owner."
            )
        ranks = [record.peers.index(self._peers[base]) for base in self._region.ranks]
        return self._runtime.restarts.respawn(record, ranks)

    def on_failure(self, handler: FailureHandler) -> None:
        """Call `handler(event)` when a proc of this mesh fails; truthy return = handled."""
        self._runtime.supervisor.handlers[self._peers[0].mesh_key] = handler

    def stop(self, grace_s: float = DEFAULT_STOP_GRACE_S) -> Future[None]:
        """Stop these procs (gracefully, then SIGKILL after `grace_s`); stopping is no failure."""
        peers = [self._peers[base] for base in self._region.ranks]
        for peer in peers:
            if peer.agent is None:
                raise ValueError(
                    "this_proc() cannot be stopped through its mesh; it is this "
                    "process (or the client) itself."
                )
            if peer.alive and self._runtime.restarts.cancel(peer) and peer.pid is None:
                # held for a restart that now will not happen: nothing runs to be stopped
                self._runtime.mark_peer_gone(peer, peer.stopped_event("by its owner"), "stopped")
        self._runtime.stop_peers([peer for peer in peers if peer.alive], grace_s)
        return all_done([peer.gone for peer in peers], self._runtime, f"stop of {self.name}")

    def __reduce__(self) -> tuple[Any, ...]:
        _wait_ready(self._peers)
        return _rebuild_proc_mesh, (self.name, self._region, _peer_infos(self._peers))

    def __repr__(self) -> str:
        return f"<ProcMesh {self.name!r} {self.sizes}>"


class _ActorMeshState:
    """What all slices of one actor mesh share."""

    __slots__ = ("actor_class", "actor_id", "endpoints", "name", "peers", "stopped", "view")

    def __init__(
        self,
        name: str,
        actor_id: str,
        actor_class: type,
        peers: tuple[ProcPeer, ...],
        extent: Extent,
    ) -> None:
        self.name = name
        self.actor_id = actor_id
        self.actor_class = actor_class
        self.peers = peers
        self.stopped = False
        self.endpoints: dict[str, str] = {}
        self.view = ActorMeshView(actor_id, name, extent, peers)


class ActorMesh(MeshBase, _Stoppable, Generic[A]):
    """One actor per proc of a proc mesh. Endpoints appear as attributes: ``mesh.step.call()``."""

    def __init__(self, runtime: Runtime, state: _ActorMeshState, region: Region) -> None:
        self._runtime = runtime
        self._state = state
        self._region = region

    @property
    def name(self) -> str:
        return self._state.name

    def _with_region(self, region: Region) -> ActorMesh[A]:
        return ActorMesh(self._runtime, self._state, region)

    def __getattr__(self, name: str) -> EndpointRef[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        state = self._state
        if name not in state.endpoints:
            state.endpoints[name] = resolve_endpoint(state.actor_class, name).name
        return EndpointRef(self, name)

    def _invoke(
        self,
        endpoint: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        indices: Iterable[int],
        sink: ResultSink | None,
        home: ReplyInbox | None,
    ) -> None:
        state = self._state
        if state.stopped:
            raise SupervisionError(
                SupervisionEvent("stopped", state.name, message="by its owner"),
                f"cannot call {state.name}.{endpoint}: ",
            )
        payload = Payload.dump((args, kwargs))
        runtime = self._runtime
        call_id = runtime.new_call_id()
        reply_to = None if sink is None else (runtime.address if home is None else home.address)
        labels, sizes, ranks = self.extent.labels, self.extent.sizes, self._region.ranks
        messages = [
            (
                state.peers[ranks[i]],
                CallActor(call_id, reply_to, state.actor_id, endpoint, labels, sizes, i),
            )
            for i in indices
        ]
        runtime.send_to_procs(messages, payload, sink, call_id, home, state.view)

    def on_failure(self, handler: FailureHandler) -> None:
        """Call `handler(event)` when an actor of this mesh fails; truthy return = handled."""
        self._runtime.supervisor.handlers[self._state.actor_id] = handler

    def _peers_in_region(self) -> list[ProcPeer]:
        """The procs that the actors of this (sliced) mesh run on, in rank order."""
        return [self._state.peers[rank] for rank in self._region.ranks]

    def _covers(self, event: SupervisionEvent) -> bool:
        """Whether `event` concerns an actor or proc that a call on this mesh reaches."""
        state = self._state
        return any(
            state.peers[r].proc_id == event.proc_id
            or event.actor_id == actor_identity(state.actor_id, r)
            for r in self._region.ranks
        )

    def stop(self) -> Future[None]:
        """Stop these actors after the messages already sent to them; later calls fail."""
        state, runtime = self._state, self._runtime
        future: Future[Any] = Future(runtime, f"stop of {state.name}")
        call_id = runtime.new_call_id()
        peers = [state.peers[base] for base in self._region.ranks]
        messages = [
            (peer, StopActor(call_id, runtime.address, state.actor_id, rank))
            for rank, peer in enumerate(peers)
            if peer.alive
        ]
        if len(self._region) == len(state.peers):
            state.stopped = True
        if not messages:
            return resolved(None)
        sink = GatherSink(future, Extent(("actors",), (len(peers),)), expected=len(messages))
        runtime.send_to_procs(messages, None, sink, call_id, mesh=state.view)
        done: Future[None] = Future(runtime, f"stop of {state.name}")
        future.add_done_callback(lambda f: done.set_result(None))
        return done

    def __reduce__(self) -> tuple[Any, ...]:
        state = self._state
        _wait_ready(state.peers)
        return _rebuild_actor_mesh, (
            state.name,
            state.actor_id,
            state.actor_class,
            self._region,
            _peer_infos(state.peers),
            state.view.extent,
        )

    def __repr__(self) -> str:
        return f"<ActorMesh {self.name!r} {self.sizes}>"


reserve_endpoint_names(ActorMesh)  # an endpoint named like a mesh attribute could not be called


def _check_fds_for_procs(runtime: Runtime, count: int) -> None:
    """Refuse to spawn `count` procs when their connections would exhaust this process's file
    descriptors (libzmq would abort it), counting the procs still starting too."""
    starting = sum(1 for peer in list(runtime.peers.values()) if peer.state == "starting")
    check_fd_headroom((count + starting) * FDS_PER_PROC, f"spawning {count} procs")


def _wait_ready(peers: Iterable[ProcPeer], timeout: float = 60.0) -> None:
    for peer in peers:
        if peer.alive and peer.address is None:
            try:
                peer.ready.get(timeout)
            except SupervisionError:
                pass


def _peer_infos(peers: Iterable[ProcPeer]) -> tuple[tuple[Any, ...], ...]:
    return tuple((p.proc_id, p.mesh_name, p.point, p.agent, p.address) for p in peers)


def _adopt_peers(runtime: Runtime, infos: tuple[tuple[Any, ...], ...]) -> tuple[ProcPeer, ...]:
    """Peers for a mesh handle received from elsewhere; their agents will tell us if they die."""
    peers = []
    watch: dict[str, list[str]] = {}
    for proc_id, mesh_name, point, agent, address in infos:
        peer = runtime.peers.get(proc_id)
        if peer is None:
            peer = runtime.add_peer(ProcPeer(proc_id, mesh_name, point, agent, address))
            if agent is not None:
                watch.setdefault(agent, []).append(proc_id)
        peers.append(peer)
    for agent, proc_ids in watch.items():
        runtime.send_message(agent, WatchProcs(tuple(proc_ids), runtime.address))
    return tuple(peers)


def _rebuild_proc_mesh(name: str, region: Region, infos: tuple[tuple[Any, ...], ...]) -> ProcMesh:
    runtime = current_session().runtime
    return ProcMesh(runtime, name, region, _adopt_peers(runtime, infos))


def _rebuild_actor_mesh(
    name: str,
    actor_id: str,
    actor_class: type,
    region: Region,
    infos: tuple[tuple[Any, ...], ...],
    extent: Extent,
) -> ActorMesh[Any]:
    runtime = current_session().runtime
    state = _ActorMeshState(name, actor_id, actor_class, _adopt_peers(runtime, infos), extent)
    return ActorMesh(runtime, state, region)


def this_host() -> HostMesh:
    """The host this code runs on; in the client, a local agent is started on first use."""
    agent = current_session().agent_address()
    return HostMesh((agent,), Region.full(Extent((), ())))


def this_proc() -> ProcMesh:
    """The process this code runs in, as a mesh of one proc (spawn actors next to you)."""
    session = current_session()
    runtime = session.runtime
    if session.proc is None:
        point = Extent((), ()).point(0)
        name = "client"
    else:
        name, labels, sizes, rank = session.proc
        point = Extent(labels, sizes).point(rank)
    peer = runtime.peers.get(runtime.proc_id)
    if peer is None:
        peer = runtime.add_peer(ProcPeer(runtime.proc_id, name, point, None, runtime.address))
    return ProcMesh(runtime, name, Region.full(Extent((), ())), (peer,))
