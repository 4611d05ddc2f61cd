"""Re-spawning failed ranks, by hand or by a `RestartPolicy`: on the agents they ran on, or
elsewhere when their host is lost (on hosts named to `respawn`, or on a policy's spare hosts).

A runtime remembers how it built each proc mesh and actor mesh it owns (`ProcMeshRecord`,
`ActorMeshRecord`), so a failed rank can be built again with the same name, point and
constructor arguments. The `ProcPeer` objects are reset in place (a moved rank's agent
changes), which is why every mesh handle the user holds works again for those ranks. The ranks
of one lost host move together to one spare host; a spare taken is no longer spare, for every
proc mesh of this process.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any, Protocol

from mesh._context import actor_identity
from mesh._engine.calltable import CallTable
from mesh._engine.future import Future, LoopPump, all_done
from mesh._engine.messages import ProcSpec, SpawnActor, SpawnProcs
from mesh._engine.ownership import ActorMeshRecord, Ownership, ProcMeshRecord
from mesh._engine.peers import ProcPeer
from mesh._engine.supervisor import Supervisor
from mesh._settings import Settings
from supervision import SupervisionEvent
from transport import Payload, get_logger


class RestartHost(LoopPump, Protocol):
    """What re-spawning needs of the runtime: sending, timers and the procs' fate."""

    def address_for(self, peer: str | None, home: Any = None) -> str:
        """This process's address to hand to the process at `peer` (`Runtime.address_for`)."""
        ...

    @property
    def settings(self) -> Settings: ...

    def send_message(self, address: str, header: Any, payload: Payload | None = None) -> None: ...

    def call_later(self, delay_s: float, function: Callable[..., Any], *args: Any) -> None: ...

    def check_agent(self, agent: str) -> None:
        """Procs were just requested from `agent`: fail them if it is known to be gone."""
        ...

    def agent_lost(self, agent: str) -> bool:
        """Whether `agent` is lost (its process died, or it went silent)."""
        ...

    def stop_peers(
        self, peers: list[ProcPeer], grace_s: float, why: str = "by its owner"
    ) -> None: ...

    def mark_peer_gone(self, peer: ProcPeer, event: SupervisionEvent, state: str) -> None: ...


class Restarts:
    """The re-spawn machinery of one runtime."""

    def __init__(
        self,
        runtime: RestartHost,
        calls: CallTable,
        ownership: Ownership,
        supervisor: Supervisor,
        proc_id: str,
    ) -> None:
        self._runtime = runtime
        self._calls = calls
        self._ownership = ownership
        self._supervisor = supervisor
        self._log = get_logger("mesh.restart", proc=proc_id)
        self._taken: dict[str, str] = {}  # spare agent -> the lost agent it replaces

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
            self._ownership.rekey(peer, new_id)
            peer.agent = record.moves.pop(rank, peer.agent)
            spec = ProcSpec(
                new_id, record.name, record.extent.labels, record.extent.sizes, rank, old_id
            )
            assert peer.agent is not None
            by_agent.setdefault(peer.agent, []).append(spec)
        for agent, specs in by_agent.items():
            runtime.send_message(
                agent,
                SpawnProcs(
                    runtime.address_for(agent),
                    tuple(specs),
                    record.env,
                    tuple(sys.path),
                    os.getcwd(),
                    record.heartbeat_interval_s,
                    record.heartbeat_timeout_s,
                    record.busy_timeout_s,
                    record.bootstrap,
                    record.forward_output,
                    record.setup,
                    record.memory_limit,
                    quiet_output=record.quiet_output,
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
            self._supervisor.forget(actor_identity(actors.actor_id, rank))
            actors.restarts[rank] += 1
            actors.failed.discard(rank)
            messages.append(
                (
                    actors.peers[rank],
                    SpawnActor(
                        actors.actor_id,
                        actor_owner(
                            self._runtime.address_for(actors.peers[rank].location), actors, rank
                        ),
                        actors.name,
                        actors.extent.labels,
                        actors.extent.sizes,
                        rank,
                        actors.restarts[rank],
                        actors.call_limit_s,
                    ),
                )
            )
        self._calls.send_to_procs(messages, actors.payload, None)

    # -- by hand -----------------------------------------------------------------------------

    def respawn(
        self, record: ProcMeshRecord, ranks: list[int] | None = None, on: list[str] | None = None
    ) -> Future[None]:
        """Re-spawn the failed procs of `record` (or `ranks`) and rebuild failed actors; on
        the agents `on` if given (the ranks of one old agent together, old agents spread over
        them), else where they ran."""
        dead = [r for r, p in enumerate(record.peers) if p.state == "failed"]
        targets = dead if ranks is None else [r for r in ranks if r in dead]
        if on:
            spread: dict[str | None, str] = {}
            for rank in targets:
                old = record.peers[rank].agent
                record.moves[rank] = spread.setdefault(old, on[len(spread) % len(on)])
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

    def restart_all(
        self, record: ProcMeshRecord, grace_s: float, why: str, done: Future[None]
    ) -> None:
        """Stop the running procs of `record` (SIGKILL after `grace_s`) and start them again
        with their actors, as a policy restart would; `done` once they are up. Loop thread."""
        ranks = list(range(len(record.peers)))
        record.restarting.update(ranks)
        live = [peer for peer in record.peers if peer.alive]
        self._runtime.stop_peers(live, grace_s, why)

        def relaunch() -> None:
            launched = self.launch(record, [r for r in ranks if r in record.restarting])
            launched.add_done_callback(lambda _: done.set_result(None))

        all_done([peer.gone for peer in live], self._runtime, "the stop").add_done_callback(
            lambda _: self._runtime.call_later(0, relaunch)
        )

    # -- by policy -----------------------------------------------------------------------------

    def on_proc_failure(self, peer: ProcPeer, event: SupervisionEvent) -> SupervisionEvent | None:
        """Apply the proc mesh's policy. None: a restart is under way (the failure is handled);
        otherwise the event to escalate."""
        record = self._ownership.proc_mesh_of(peer)
        if record is None or record.tracker is None:
            return event
        rank = record.peers.index(peer)
        if rank in record.restarting:  # already part of a restart under way
            self._hold_calls(peer)
            return None
        decision = record.tracker.on_failure(
            rank, clean_exit=event.kind == "exit" and event.exit_code == 0
        )
        if decision.escalate:
            return dataclasses.replace(
                event, message=_joined(event.message, f"not restarted: {decision.reason}")
            )
        refusal = self._move_off_lost_hosts(record, decision.ranks)
        if refusal:
            return dataclasses.replace(event, message=_joined(event.message, refusal))
        self._log.info(
            "restart_scheduled",
            mesh=record.name,
            ranks=list(decision.ranks),
            delay_s=decision.delay_s,
            attempt=decision.attempt,
        )
        record.restarting.update(decision.ranks)
        self._hold_calls(peer)  # calls made meanwhile wait for the new proc
        self._runtime.call_later(decision.delay_s, self._restart, record, list(decision.ranks))
        return None

    def _move_off_lost_hosts(self, record: ProcMeshRecord, ranks: tuple[int, ...]) -> str:
        """Send the `ranks` whose agent is lost to a spare agent (those of one lost agent to
        the same one). Returns why not, in words, if some cannot go anywhere ("" if all can)."""
        runtime = self._runtime
        for rank in ranks:
            peer = record.peers[rank]
            agent = peer.agent
            if agent is None or rank in record.moves or not runtime.agent_lost(agent):
                continue
            if record.spares is None:  # in place: a silent agent may only be cut off
                continue
            spare = self._spare_for(record, agent)
            if spare is None:
                where = f"its host {peer.host} (agent at {agent})" if peer.host else agent
                return (
                    f"not restarted: {where} is lost and no spare host is left (spares: "
                    f"{', '.join(record.spares) or 'none'}, all taken or lost)"
                )
            record.moves[rank] = spare
            self._log.warning("rank_moved", mesh=record.name, rank=rank, lost=agent, spare=spare)
        return ""

    def _spare_for(self, record: ProcMeshRecord, lost: str) -> str | None:
        """The spare agent of `record` that replaces agent `lost` (taking a free one)."""
        spares = record.spares or ()
        for spare in spares:
            if self._taken.get(spare) == lost and not self._runtime.agent_lost(spare):
                return spare
        for spare in spares:
            if spare not in self._taken and not self._runtime.agent_lost(spare):
                self._taken[spare] = lost
                return spare
        return None

    def on_actor_failure(
        self, actor_id: str, rank: int, event: SupervisionEvent
    ) -> SupervisionEvent | None:
        """An actor failed on a proc that still runs: rebuild it there if a policy says so."""
        actors = self._ownership.actor_mesh(actor_id)
        if actors is None:
            return event
        actors.failed.add(rank)
        record = self._ownership.proc_mesh_of(actors.peers[rank])
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

    def cancel(self, peer: ProcPeer) -> bool:
        """`peer` is being stopped: drop a restart pending for it. True if one was."""
        record = self._ownership.proc_mesh_of(peer)
        if record is None:
            return False
        rank = record.peers.index(peer)
        if rank not in record.restarting:
            return False
        record.restarting.discard(rank)
        return True

    def _hold_calls(self, peer: ProcPeer) -> None:
        """A failed peer will be re-spawned: from now on calls to it wait for the new proc,
        for at most settings.restart_wait_s."""
        with self._ownership.lock:
            peer.hold()
            ready = peer.ready
        wait_s = self._runtime.settings.restart_wait_s
        self._runtime.call_later(wait_s, self._restart_overdue, peer, ready)

    def _restart_overdue(self, peer: ProcPeer, ready: Future[None]) -> None:
        if peer.ready is not ready or ready.finished() or peer.state != "starting":
            return  # it came back (or failed, or was stopped) in time
        self.cancel(peer)
        message = f"its restart did not complete within {self._runtime.settings.restart_wait_s} s"
        self._runtime.mark_peer_gone(peer, peer.make_event("spawn_failed", message), "failed")


def _joined(first: str, second: str) -> str:
    return f"{first}; {second}" if first else second


def actor_owner(address: str, actors: ActorMeshRecord, rank: int) -> str:
    """Where the actor at `rank` reports its failure: this process at `address`, or, on a
    detached mesh, its host agent (which forwards it to the mesh's owner of the moment)."""
    agent = actors.peers[rank].agent
    return agent if actors.detached and agent is not None else address
