"""Re-spawning failed ranks on the agents they ran on, by hand or by a `RestartPolicy`.

A runtime remembers how it built each proc mesh and actor mesh it owns (`ProcMeshRecord`,
`ActorMeshRecord`), so a failed rank can be built again with the same name, point, agent and
constructor arguments. The `ProcPeer` objects are reset in place, which is why every mesh
handle the user holds works again for those ranks.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mesh._context import actor_identity
from mesh._engine.future import Future, all_done
from mesh._engine.messages import ProcSpec, SpawnActor, SpawnProcs
from mesh._engine.peers import ActorMeshView, ProcPeer
from mesh._shape import Extent
from supervision import RestartPolicy, RestartTracker, SupervisionEvent
from transport import Payload, get_logger

if TYPE_CHECKING:
    from mesh._engine.runtime import Runtime


@dataclass
class ActorMeshRecord:
    """How an actor mesh was built: enough to build any of its ranks again."""

    actor_id: str
    name: str
    payload: Payload
    extent: Extent
    peers: tuple[ProcPeer, ...]
    owner_actor: str | None
    restarts: list[int] = field(default_factory=list)
    failed: set[int] = field(default_factory=set)

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


class Restarts:
    """The re-spawn machinery of one runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self.proc_meshes: dict[str, ProcMeshRecord] = {}
        self._by_proc: dict[int, ProcMeshRecord] = {}  # id(peer) -> its proc mesh
        self.actor_meshes: dict[str, ActorMeshRecord] = {}
        self._log = get_logger("mesh.restart", proc=runtime.proc_id)

    def add_proc_mesh(self, record: ProcMeshRecord, policy: RestartPolicy | None) -> None:
        if policy is not None:
            record.tracker = RestartTracker(policy, len(record.peers))
        self.proc_meshes[record.key] = record
        for peer in record.peers:
            self._by_proc[id(peer)] = record

    def add_actor_mesh(self, record: ActorMeshRecord) -> None:
        self.actor_meshes[record.actor_id] = record
        meshes = {
            id(self._by_proc.get(id(peer))): self._by_proc.get(id(peer)) for peer in record.peers
        }
        for proc_mesh in meshes.values():
            if proc_mesh is not None:
                proc_mesh.actor_meshes.append(record)

    # -- launching -------------------------------------------------------------------------

    def launch(self, record: ProcMeshRecord, ranks: list[int]) -> Future[None]:
        """(Re)build the procs at `ranks` of `record`, then the actors that lived on them."""
        runtime = self._runtime
        record.generation += 1
        record.restarting.difference_update(ranks)
        by_agent: dict[str, list[ProcSpec]] = {}
        for rank in ranks:
            peer = record.peers[rank]
            suffix = f"-r{record.generation - 1}" if record.generation > 1 else ""
            new_id = f"{record.key}-{rank}{suffix}"
            old_id = peer.proc_id if suffix else ""
            runtime.rekey_peer(peer, new_id)
            spec = ProcSpec(
                new_id, record.name, record.extent.labels, record.extent.sizes, rank, old_id
            )
            assert peer.agent is not None
            by_agent.setdefault(peer.agent, []).append(spec)
        for agent, specs in by_agent.items():
            runtime.send_message(
                agent,
                SpawnProcs(
                    runtime.address,
                    tuple(specs),
                    record.env,
                    tuple(sys.path),
                    os.getcwd(),
                    record.heartbeat_interval_s,
                    record.heartbeat_timeout_s,
                    record.busy_timeout_s,
                ),
            )
            runtime.check_agent(agent)  # a gone agent never answers: fail its procs now
        for actors in record.actor_meshes:
            self._rebuild_actors(
                actors, [r for r, p in enumerate(actors.peers) if record.peers.index(p) in ranks]
            )
        self._log.info("procs_respawned", mesh=record.name, ranks=ranks)
        return all_done([record.peers[r].ready for r in ranks], runtime, "the re-spawn")

    def _rebuild_actors(self, actors: ActorMeshRecord, ranks: list[int]) -> None:
        messages = []
        for rank in ranks:
            self._runtime.supervisor.forget(actor_identity(actors.actor_id, rank))
            actors.restarts[rank] += 1
            actors.failed.discard(rank)
            messages.append(
                (
                    actors.peers[rank],
                    SpawnActor(
                        actors.actor_id,
                        self._runtime.address,
                        actors.name,
                        actors.extent.labels,
                        actors.extent.sizes,
                        rank,
                        actors.restarts[rank],
                    ),
                )
            )
        self._runtime.send_to_procs(messages, actors.payload, None)

    # -- by hand -----------------------------------------------------------------------------

    def respawn(self, record: ProcMeshRecord, ranks: list[int] | None = None) -> Future[None]:
        """Re-spawn the failed procs of `record` (or `ranks`) and rebuild failed actors."""
        dead = [r for r, p in enumerate(record.peers) if p.state == "failed"]
        targets = dead if ranks is None else [r for r in ranks if r in dead]
        ready = self.launch(record, targets) if targets else None
        allowed = set(range(len(record.peers)) if ranks is None else ranks)
        for actors in record.actor_meshes:  # actors that failed on procs that still run
            alive = [
                r
                for r in sorted(actors.failed)
                if record.peers.index(actors.peers[r]) in allowed
                and record.peers.index(actors.peers[r]) not in targets
            ]
            if alive:
                self._rebuild_actors(actors, alive)
        return ready or all_done([], self._runtime, "the re-spawn")

    # -- by policy -----------------------------------------------------------------------------

    def on_proc_failure(self, peer: ProcPeer, event: SupervisionEvent) -> SupervisionEvent | None:
        """Apply the proc mesh's policy. None: a restart is under way (the failure is handled);
        otherwise the event to escalate."""
        record = self._by_proc.get(id(peer))
        if record is None or record.tracker is None:
            return event
        rank = record.peers.index(peer)
        if rank in record.restarting:  # already part of a restart under way
            self._runtime.hold_calls(peer)
            return None
        decision = record.tracker.on_failure(
            rank, clean_exit=event.kind == "exit" and event.exit_code == 0
        )
        if decision.escalate:
            return dataclasses.replace(
                event, message=_joined(event.message, f"not restarted: {decision.reason}")
            )
        self._log.info(
            "restart_scheduled",
            mesh=record.name,
            ranks=list(decision.ranks),
            delay_s=decision.delay_s,
            attempt=decision.attempt,
        )
        record.restarting.update(decision.ranks)
        self._runtime.hold_calls(peer)  # calls made meanwhile wait for the new proc
        self._runtime.call_later(decision.delay_s, self._restart, record, list(decision.ranks))
        return None

    def on_actor_failure(
        self, actor_id: str, rank: int, event: SupervisionEvent
    ) -> SupervisionEvent | None:
        """An actor failed on a proc that still runs: rebuild it there if a policy says so."""
        actors = self.actor_meshes.get(actor_id)
        if actors is None:
            return event
        actors.failed.add(rank)
        record = self._by_proc.get(id(actors.peers[rank]))
        if record is None or record.tracker is None:
            return event
        decision = record.tracker.on_failure(record.peers.index(actors.peers[rank]))
        if decision.escalate:
            return dataclasses.replace(
                event, message=_joined(event.message, f"not restarted: {decision.reason}")
            )
        self._log.info(
            "actor_restart_scheduled", mesh=actors.name, rank=rank, delay_s=decision.delay_s
        )
        self._runtime.call_later(decision.delay_s, self._rebuild_actors, actors, [rank])
        return None

    def _restart(self, record: ProcMeshRecord, ranks: list[int]) -> None:
        ranks = [r for r in ranks if r in record.restarting]  # not stopped meanwhile
        if not ranks:
            return
        healthy = [
            r for r in ranks if record.peers[r].state == "ready" and record.peers[r].pid is not None
        ]
        if healthy:  # one_for_all / rest_for_one: stop the others first
            siblings = [record.peers[r] for r in healthy]
            self._runtime.stop_peers(siblings, 0.0, "to be restarted with its siblings")
            pending = [record.peers[r].gone for r in healthy]
            all_done(pending, self._runtime, "the stop of siblings").add_done_callback(
                lambda _: self._runtime.call_later(0, self._relaunch, record, ranks)
            )
            return
        self.launch(record, ranks)

    def _relaunch(self, record: ProcMeshRecord, ranks: list[int]) -> None:
        ranks = [r for r in ranks if r in record.restarting]
        if ranks:
            self.launch(record, ranks)

    def forget_stopped(self, peer: ProcPeer) -> ProcMeshRecord | None:
        """Drop the record of `peer`'s proc mesh (and of the actor meshes on it) once all its
        procs are stopped: none can be re-spawned any more. Returns the record dropped."""
        record = self._by_proc.get(id(peer))
        if record is None or any(p.state != "stopped" for p in record.peers):
            return None
        self.proc_meshes.pop(record.key, None)
        for each in record.peers:
            self._by_proc.pop(id(each), None)
        for actors in record.actor_meshes:
            self.actor_meshes.pop(actors.actor_id, None)
        return record

    def cancel(self, peer: ProcPeer) -> bool:
        """`peer` is being stopped: drop a restart pending for it. True if one was."""
        record = self._by_proc.get(id(peer))
        if record is None:
            return False
        rank = record.peers.index(peer)
        if rank not in record.restarting:
            return False
        record.restarting.discard(rank)
        return True


def _joined(first: str, second: str) -> str:
    return f"{first}; {second}" if first else second
