"""`ProcLifecycle`: what a process learns about the procs it calls or owns, and what follows.

Procs become ready, are replaced by a re-spawn, exit, fail to spawn, or are stopped on purpose.
A proc that is gone fails the calls waiting on it; the failure of an owned one goes to its
restart policy, else up the supervision tree, as the actor meshes on it see it.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Any, Protocol

from mesh._engine.calltable import CallTable
from mesh._engine.fork import check_not_forked
from mesh._engine.messages import (
    ActorFailed,
    ProcExited,
    ProcReady,
    ProcReplaced,
    SpawnFailed,
    StopProcs,
)
from mesh._engine.ownership import Ownership
from mesh._engine.peers import ProcPeer
from mesh._engine.proc_faults import DUMP_SIGNAL
from mesh._engine.restarts import Restarts
from mesh._engine.supervisor import Supervisor
from supervision import EventKind, SupervisionError, SupervisionEvent
from transport import Envelope, Outbox, Payload, get_logger


class ProcsHost(Protocol):
    """What the procs' lifecycle needs of the runtime."""

    def address_for(self, peer: str | None, home: Any = None) -> str:
        """This process's address to hand to the process at `peer` (`Runtime.address_for`)."""
        ...

    @property
    def pid(self) -> int: ...

    @property
    def closing(self) -> bool:
        """Whether the process is shutting down: exits are expected then."""
        ...

    @property
    def outbox(self) -> Outbox: ...

    def send_message(self, address: str, header: Any, payload: Payload | None = None) -> None: ...


class ProcLifecycle:
    """Handles the proc-lifecycle messages, and stops procs on purpose."""

    def __init__(
        self,
        runtime: ProcsHost,
        ownership: Ownership,
        calls: CallTable,
        supervisor: Supervisor,
        restarts: Restarts,
        proc_id: str,
    ) -> None:
        self._runtime = runtime
        self._ownership = ownership
        self._lock = ownership.lock
        self._calls = calls
        self._supervisor = supervisor
        self._restarts = restarts
        self._stuck: dict[str, SupervisionEvent] = {}  # procs killed for a stuck call
        self._log = get_logger("mesh.runtime", proc=proc_id)

    # -- coming up -----------------------------------------------------------------------------

    def on_proc_replaced(self, envelope: Envelope) -> None:
        """A proc this process calls (but does not own) was re-spawned: follow it."""
        header: ProcReplaced = envelope.header
        peer = self._ownership.peer(header.old_proc_id)
        if peer is None or peer.owned:
            return
        self._ownership.rekey(peer, header.proc_id)
        with self._lock:
            if peer.state != "starting":  # its old proc's exit never reached us
                peer.hold()
        self._peer_ready(ProcReady(header.proc_id, header.address, header.pid, header.host))

    def on_proc_ready(self, envelope: Envelope) -> None:
        self._peer_ready(envelope.header)

    def _peer_ready(self, header: ProcReady) -> None:
        with self._lock:
            peer = self._ownership.peer(header.proc_id)
            if peer is None or peer.state != "starting":
                return
            peer.address, peer.pid, peer.host, peer.state = (
                header.address,
                header.pid,
                header.host,
                "ready",
            )
            queued, peer.queued = peer.queued, []
            for frames in queued:
                self._runtime.outbox.send(header.address, frames)
        peer.ready.set_result(None)
        self._log.info("proc_ready", proc=header.proc_id, pid=header.pid, address=header.address)

    # -- going away ----------------------------------------------------------------------------

    def on_proc_exited(self, envelope: Envelope) -> None:
        header: ProcExited = envelope.header
        peer = self._ownership.peer(header.proc_id)
        if peer is None:
            return
        stuck = self._stuck.pop(header.proc_id, None)
        kind: EventKind
        if peer.state == "stopping":
            kind, message = "stopped", "by its owner"
        elif stuck is not None:  # already its callers' event: one failure, one event
            self.mark_peer_gone(peer, _about_proc(stuck, peer), "failed")
            return
        elif header.out_of_memory:  # the true cause, even when the agent declared it hung
            kind, message = "oom", header.out_of_memory + _also_hung(header)
        elif header.requested:
            kind, message = "stopped", _by_its_owner(header.why_stopped)
        elif header.hung:
            kind, message = "hung", f"it was killed by the host agent ({_how(header.signal)})"
            if header.why_hung:
                message = f"{header.why_hung}; {message}"
        elif header.signal is not None:
            kind, message = "signal", ""
        else:
            kind, message = "exit", ""
        event = peer.make_event(
            kind,
            message,
            host=header.host,
            pid=header.pid,
            exit_code=header.exit_code,
            signal=None if kind == "hung" else header.signal,
            traceback=header.traceback or None if kind != "stopped" else None,
        )
        self.mark_peer_gone(peer, event, "stopped" if kind == "stopped" else "failed")

    def on_spawn_failed(self, envelope: Envelope) -> None:
        header: SpawnFailed = envelope.header
        peer = self._ownership.peer(header.proc_id)
        if peer is not None:
            event = peer.make_event("spawn_failed", header.reason, host=header.host)
            self.mark_peer_gone(peer, event, "failed")

    def mark_peer_gone(self, peer: ProcPeer, event: SupervisionEvent, state: str) -> None:
        """Record that `peer` is gone and fail every call still waiting on it."""
        with self._lock:
            if peer.finished:
                return
            peer.state, peer.event, peer.queued = state, event, []
            waiting = self._calls.take_waiting_on(peer)
        if peer.address:
            self._runtime.outbox.forget(peer.address)
        error = SupervisionError(event)
        ready, gone = peer.ready, peer.gone
        escalate: SupervisionEvent | None = None
        if state == "failed" and peer.owned and not self._runtime.closing:
            self._supervisor.observe(self._told_to_owner(peer, event)[0])
            # decide (and hold the peer for a restart) before anyone hears of the failure
            escalate = self._restarts.on_proc_failure(peer, event)
        ready.set_exception(error)
        gone.set_result(None)
        self._calls.fail_waiting(peer, event, waiting)
        if escalate is not None:
            subject, told = self._told_to_owner(peer, escalate)
            self._supervisor.handle(subject, peer.owner_actor, tuple(told), told)
        elif state == "stopped":
            self._log.info("proc_stopped", proc=peer.proc_id, pid=event.pid)
            self._forget_if_stopped(peer)

    def _forget_if_stopped(self, peer: ProcPeer) -> None:
        """Drop the bookkeeping of a stopped proc (of its whole mesh, for one spawned here):
        handles the user still holds keep working, and say it was stopped."""
        if peer.owned:
            self._ownership.forget_if_stopped(peer)
        else:
            self._ownership.drop_peers((peer,))

    def _told_to_owner(
        self, peer: ProcPeer, event: SupervisionEvent
    ) -> tuple[SupervisionEvent, dict[str, SupervisionEvent]]:
        """What the owner hears of `peer`'s proc failing: the event of the actor mesh whose
        actor `event` names (a stuck one), else of the first on it (the proc's own if none),
        and the event each handler key hears (an actor mesh's handler: its actor's; the proc
        mesh's handler: the proc's), in the order of asking."""
        told = {
            actors.actor_id: actors.view().proc_failed(peer, event)
            for actors in self._ownership.actor_meshes_on(peer)
        }
        named = [e for e in told.values() if event.actor_id and e.actor_id == event.actor_id]
        subject = next(iter(named or told.values()), event)  # a stuck actor's event first
        told[peer.mesh_key] = event
        return subject, told

    def on_actor_failed(self, envelope: Envelope) -> None:
        header: ActorFailed = envelope.header
        event: SupervisionEvent = envelope.payload.load()  # type: ignore[union-attr]
        self._supervisor.observe(event)
        if event.kind == "stuck" and self._kill_stuck(header, event):
            return  # decided once its proc is gone, as for a hung one
        escalate = self._restarts.on_actor_failure(header.actor_id, header.rank, event)
        if escalate is None:
            return  # a restart policy takes care of it
        peer = self._ownership.peer(event.proc_id or "")
        keys = (header.actor_id,) + ((peer.mesh_key,) if peer is not None else ())
        owner = self._ownership.owner_of(header.actor_id)
        self._supervisor.handle(escalate, owner, keys)

    def _kill_stuck(self, header: ActorFailed, event: SupervisionEvent) -> bool:
        """An actor of a proc owned here is stuck in a call that cannot be cancelled: kill the
        proc (its exit is then this failure). False if it is not owned here or is going."""
        actors = self._ownership.actor_mesh(header.actor_id)
        if actors is None or not 0 <= header.rank < len(actors.peers):
            return False
        peer = actors.peers[header.rank]
        if not peer.owned or not peer.alive or peer.agent is None:
            return False
        self._stuck[peer.proc_id] = event
        self._log.warning("stuck_proc_killed", proc=peer.proc_id, pid=peer.pid)
        why = f"actor {header.actor_id} on it was stuck: {event.message}"[:_MOST_WHY_CHARS]
        reply_to = self._runtime.address_for(peer.agent)
        self._runtime.send_message(peer.agent, StopProcs((peer.proc_id,), 0.0, reply_to, why))
        return True

    def fail_procs_of(self, agent: str, why: str) -> None:
        """Every live proc of `agent` failed with kind "unreachable" (`why`: the agent's fate);
        each event names the host (learned when its procs started), even for one still
        starting."""
        on_agent = [p for p in self._ownership.all_peers() if p.agent == agent]
        host = next((p.host for p in on_agent if p.host), None)
        lost = [p for p in on_agent if p.alive]
        for peer in lost:
            event = peer.make_event("unreachable", f"its host agent {why}", host=peer.host or host)
            self.mark_peer_gone(peer, event, "failed")
        # If the agent is only cut off, it gets this once the link is back: procs given up
        # for lost must not live on beside their replacements.
        owned = tuple(p.proc_id for p in lost if p.owned)
        if owned:
            self._runtime.send_message(agent, StopProcs(owned, 0.0))

    # -- stopping on purpose -------------------------------------------------------------------

    def stop_peers(self, peers: list[ProcPeer], grace_s: float, why: str = "by its owner") -> None:
        """Stop these procs on purpose: gracefully, SIGKILL after `grace_s`; their exit is
        reported as "stopped", never as a failure."""
        check_not_forked(self._runtime.pid)
        by_agent: dict[str, list[str]] = {}
        with self._lock:
            for peer in peers:
                if peer.alive and peer.agent is not None:
                    peer.state, peer.event = "stopping", peer.stopped_event(why)
                    by_agent.setdefault(peer.agent, []).append(peer.proc_id)
        for agent, proc_ids in by_agent.items():
            self._runtime.send_message(
                agent, StopProcs(tuple(proc_ids), grace_s, self._runtime.address_for(agent))
            )

    def stop_owned_by(self, actor_id: str, grace_s: float = 5.0) -> None:
        """Stop every proc that actor `actor_id` spawned (a mesh never outlives its owner)."""
        owned = [p for p in self._ownership.all_peers() if p.owner_actor == actor_id]
        self.stop_peers(owned, grace_s, "because its owner stopped or failed")

    def stop_all_owned(self, grace_s: float) -> None:
        """Ask the agents to stop every proc this process spawned (at shutdown)."""
        owned = [p for p in self._ownership.all_peers() if p.owned and p.alive]
        self.stop_peers([p for p in owned if not self._detached(p)], grace_s)

    def _detached(self, peer: ProcPeer) -> bool:
        """Whether `peer` belongs to a detached mesh, which outlives this process."""
        record = self._ownership.proc_mesh_of(peer)
        return record is not None and bool(record.detached)


def _how(signame: str | None) -> str:
    """How the agent killed a hung proc: the signal's name, said in words for the dump one."""
    if DUMP_SIGNAL is not None and signame == f"SIGRTMIN+{DUMP_SIGNAL - signal.SIGRTMIN}":
        return f"{signame}, its stack-dump signal"
    return str(signame)


def _also_hung(header: ProcExited) -> str:
    """That a proc which ran out of memory had also been declared hung before it died (slowed
    down by its memory use), or ""."""
    if header.hung:
        return f"; its host agent had also declared it hung meanwhile: {header.why_hung}"
    return ""


def _about_proc(event: SupervisionEvent, peer: ProcPeer) -> SupervisionEvent:
    """A stuck actor's `event` as the failure of its proc `peer`: it names the proc mesh, and
    still the stuck actor, so that the actor mesh's view of it is the very event its caller
    got (the root then raises it once)."""
    return dataclasses.replace(event, mesh_name=peer.mesh_name, rank=peer.point)


#: The longest reason a proc's owner gives its watchers when it stops the proc.
_MOST_WHY_CHARS = 2000


def _by_its_owner(why: str) -> str:
    """How a watcher (not the owner) words a proc stopped by its owner, who said `why`."""
    return f"by its owner, because {why}" if why else "by its owner"
