"""`ProcMesh`: OS processes, one per point; actors are spawned onto them."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from mesh._actor import check_actor_class
from mesh._api.actor_mesh import ActorMesh, ActorMeshState
from mesh._api.detached import actor_mesh_handle, announce_actors
from mesh._api.log_options import (
    check_logging_option,
    flush_logs,
    owned_record,
    set_logging_option,
)
from mesh._api.mesh_base import (
    DEFAULT_STOP_GRACE_S,
    MeshBase,
    Stoppable,
    adopt_peers,
    check_name,
    peer_infos,
    wait_ready,
)
from mesh._context import context
from mesh._engine.future import Future, all_done, resolved
from mesh._engine.messages import SpawnActor
from mesh._engine.ownership import ActorMeshRecord, FailureHandler
from mesh._engine.peers import ProcPeer
from mesh._engine.restarts import actor_owner
from mesh._engine.runtime import Runtime
from mesh._engine.session import current_session
from mesh._shape import Extent, Region
from transport import Payload

A = TypeVar("A")


class Hosts(Protocol):
    """What `ProcMesh.respawn` needs of a `HostMesh` (which imports this module)."""

    def _agents_in_order(self) -> list[str]: ...


class ProcMesh(MeshBase, Stoppable):
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

    @property
    def mesh_key(self) -> str:
        """The key its owner's registry knows this proc mesh by."""
        return self._peers[0].mesh_key

    def spawn(self, name: str, actor_class: type[A], *args: Any, **kwargs: Any) -> ActorMesh[A]:
        """One `actor_class(*args, **kwargs)` per proc; returns at once, calls wait for it."""
        check_actor_class(actor_class)
        check_name("actor mesh", name)
        payload = Payload.dump((actor_class, args, kwargs))
        actor_id = f"{name}-{secrets.token_hex(4)}"
        extent = self.extent
        peers = tuple(self._peers[base] for base in self._region.ranks)
        limit = self._runtime.settings.call_limit_s
        owner = self._runtime.address_for
        messages = [
            (
                peer,
                SpawnActor(
                    actor_id,
                    owner(peer.location),
                    name,
                    extent.labels,
                    extent.sizes,
                    rank,
                    0,
                    limit,
                ),
            )
            for rank, peer in enumerate(peers)
        ]
        record = ActorMeshRecord(
            actor_id, name, payload, extent, peers, context().actor_id, call_limit_s=limit
        )
        record.actor_class = actor_class
        mesh = self._runtime.ownership.proc_mesh_of(peers[0])
        if mesh is not None and mesh.detached:  # its failures go to the agents, which keep them
            record.detached = True
            messages = [
                (peer, dataclasses.replace(m, owner=actor_owner("", record, rank)))
                for rank, (peer, m) in enumerate(messages)
            ]
            announce_actors(self._runtime, mesh, record, (args, kwargs))
        self._runtime.ownership.add_actor_mesh(record)
        self._runtime.calls.send_to_procs(messages, payload, None)
        state = ActorMeshState(name, actor_id, actor_class, peers, extent)
        return ActorMesh(self._runtime, state, Region.full(extent))

    def actor_mesh(self, name: str) -> ActorMesh[Any]:
        """The actor mesh `name` spawned on this proc mesh by this process, or by the client
        it was adopted from (`HostMesh.adopt_procs`); KeyError naming those there are."""
        return actor_mesh_handle(self._runtime, self._actor_record(name))

    def get_or_spawn(
        self, name: str, actor_class: type[A], *args: Any, **kwargs: Any
    ) -> ActorMesh[A]:
        """The actor mesh `name` on these procs if there is one (spawned here or adopted),
        else a new one of `actor_class(*args, **kwargs)`: for scripts run again and again."""
        try:
            record = self._actor_record(name)
        except KeyError:
            return self.spawn(name, actor_class, *args, **kwargs)
        held = getattr(record.actor_class, "__qualname__", "?")
        if held != actor_class.__qualname__:
            raise TypeError(
                f"actor mesh {name!r} holds {held} actors, not {actor_class.__qualname__}; "
                "pick another name"
            )
        return actor_mesh_handle(self._runtime, record)

    def _actor_record(self, name: str) -> ActorMeshRecord:
        found = self._runtime.ownership.actor_meshes_on(self._peers[0])
        for record in reversed(found):
            if record.name == name and record.actor_class is not None:
                return record
        names = sorted({record.name for record in found})
        raise KeyError(f"proc mesh {self.name!r} has no actor mesh {name!r} (it has {names})")

    def respawn(
        self, ranks: Sequence[int] | None = None, *, on: Hosts | None = None
    ) -> Future[None]:
        """Re-spawn the failed procs of this mesh (or of its `ranks`, row-major indices of
        this mesh) and rebuild failed actors: same name, points and constructor arguments;
        healthy ranks untouched. They go to the hosts of `on` (a `HostMesh`: a spare for a
        lost host; the procs of one old host together, old hosts spread over those of `on`),
        else to the hosts they ran on. The future is done when the new procs are up; calls
        made meanwhile wait for them."""
        bases = list(self._region.ranks)
        if ranks is not None:
            bad = [r for r in ranks if not 0 <= r < len(bases)]
            if bad:
                raise ValueError(
                    f"ranks {bad} are not in proc mesh {self.name!r} of {len(bases)} ranks"
                )
            bases = [bases[r] for r in ranks]
        agents = on._agents_in_order() if on is not None else None
        record = self._runtime.ownership.proc_mesh(self._peers[0].mesh_key)
        if record is None and all(peer.state == "stopped" for peer in self._peers):
            return resolved(None)  # stopped on purpose: nothing failed, nothing to re-spawn
        if record is None:
            raise ValueError(
                f"proc mesh {self.name!r} was not spawned by this process, so it "
                "cannot re-spawn it; ask its owner."
            )
        indices = [record.peers.index(self._peers[base]) for base in bases]
        return self._runtime.restarts.respawn(record, indices, agents)

    def logging_option(
        self,
        stream_to_client: bool = True,
        aggregate_window_sec: float | None = 3,
        level: int = logging.INFO,
        *,
        aggregate_similar: bool = True,
    ) -> Future[None]:
        """Where this mesh's procs' stdout/stderr lines go from now on (the whole mesh, also
        when called on a slice; re-spawned procs too): to this process, printed with their
        mesh and point, identical lines of many ranks within `aggregate_window_sec` shown
        once with their ranks (``[4 ranks: trainers{gpus=0..3}] loss 0.12``; None: each line
        at once), and lines that differ only in their numbers too unless not
        `aggregate_similar` (``loss {0.12..0.19}``), or, with ``stream_to_client=False``, held
        back here. `level` is the procs' root `logging` level. Without a call, lines go to the
        host agent's own output, which for `this_host()` is this terminal. Done once the lines
        printed before are handled; as Monarch's (its future may be awaited; ``get()`` also
        works). Every line is also in the procs' log files (``meshvisor logs``).
        """
        mode = check_logging_option(
            stream_to_client, aggregate_window_sec, level, aggregate_similar
        )
        record = owned_record(self._runtime, self._peers, self.name)
        return set_logging_option(self._runtime, record, mode, level)

    def flush_logs(self) -> Future[None]:
        """Done once every line this mesh's procs printed before is shown (aggregated lines
        at once); a sync point for scripts and tests. Needs `logging_option` to matter."""
        return flush_logs(self._runtime, owned_record(self._runtime, self._peers, self.name))

    def on_failure(self, handler: FailureHandler) -> None:
        """Call `handler(event)` when a proc of this mesh fails; truthy return = handled."""
        self._runtime.ownership.set_handler(self._peers[0].mesh_key, handler)

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
        wait_ready(self._peers)
        return _rebuild_proc_mesh, (self.name, self._region, peer_infos(self._peers))

    def __repr__(self) -> str:
        return f"<ProcMesh {self.name!r} {self.sizes}>"


def _rebuild_proc_mesh(name: str, region: Region, infos: tuple[tuple[Any, ...], ...]) -> ProcMesh:
    runtime = current_session().runtime
    return ProcMesh(runtime, name, region, adopt_peers(runtime, infos))


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
    peer = runtime.ownership.peer(runtime.proc_id)
    if peer is None:
        peer = runtime.ownership.add_peer(
            ProcPeer(runtime.proc_id, name, point, None, runtime.address)
        )
    return ProcMesh(runtime, name, Region.full(Extent((), ())), (peer,))
