"""`DetachedMeshes`: the detached meshes whose procs this agent runs, kept when their owner
goes away, until a new client adopts them (or they are stopped, or outlive their `ttl_s`).

While a mesh has no live owner, the failures of its procs (exit reports) and actors
(`ActorFailed`, which its procs send here) are kept, at most `KEPT_LIMIT` per mesh, and
logged; the adopter gets them once it knows the procs (`ClaimDone`). Failures sent to an
owner shortly before it was found gone are kept again: it may never have read them. The first
agent of a mesh arbitrates: it refuses a second name, and a claim while another owner lives.
An owner on this host is watched through its pid (gone at once); others by their
`OwnerAlive` messages (gone after the owner timeout). An answer its actors could not send to
their caller (`ReplyLost`) goes to the owner, which ends or forwards that call; without an
owner, the caller is sent the call's failure from here, and the `ReplyLost` is kept like a
failure for the adopter, which forwards it with its keys.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from mesh._agent.detached_mesh import KEPT_LIMIT, DetachedMesh
from mesh._agent.procs import ProcRecord, ProcTable
from mesh._agent.watchdog import Watchdog
from mesh._engine.detached_messages import (
    ClaimDone,
    ClaimMesh,
    DetachActors,
    DetachedInfo,
    DetachedListing,
    DetachedProc,
    DetachedStopped,
    DetachMesh,
    ListDetached,
    MeshClaim,
    Registered,
    StopDetached,
)
from mesh._engine.messages import ActorFailed, Failure, ProcExited, ReplyLost
from transport import Envelope, Outbox, Payload, TransportError, encode

#: Grace of the procs of a mesh stopped because it outlived its ttl_s.
TTL_STOP_GRACE_S = 5.0


class DetachedMeshes:
    """The detached meshes of one host agent: registration, failures, claims, listing."""

    def __init__(
        self,
        procs: ProcTable,
        watchdog: Watchdog,
        outbox: Outbox,
        stop: Callable[[tuple[str, ...], float], None],
        log: Any,
        where: tuple[str, str],
        persistent: bool,
    ) -> None:
        self._procs = procs
        self._watchdog = watchdog
        self._outbox = outbox
        self._stop_procs = stop
        self._address, self._hostname = where
        self._log = log
        self._persistent = persistent
        self._meshes: dict[str, DetachedMesh] = {}
        self._mesh_of_actors: dict[str, str] = {}
        self._handlers: dict[type, Callable[[Envelope], None]] = {
            DetachMesh: self._register,
            DetachActors: self._add_actors,
            ListDetached: self._list,
            ClaimMesh: self._claim,
            ClaimDone: self._claim_done,
            StopDetached: self._stop,
            ActorFailed: self._actor_failed,
            ReplyLost: self._reply_lost,
        }

    def handle(self, envelope: Envelope) -> bool:
        """Handle a message of detached meshes; False if it is none."""
        handler = self._handlers.get(type(envelope.header))
        if handler is None:
            return False
        handler(envelope)
        return True

    def recipients(self, proc: ProcRecord, report: ProcExited) -> set[str]:
        """Who hears that `proc` exited: its owner and watchers, but the exit of a proc of a
        detached mesh without a live owner is kept for the adopter instead."""
        mesh = self._meshes.get(proc.detached) if proc.detached else None
        if mesh is None:
            return {proc.owner, *proc.watchers}
        if report.requested:
            self._forget_if_stopped(mesh, proc.proc_id)
            return {proc.owner, *proc.watchers}
        return proc.watchers | ({proc.owner} if self._deliver(mesh, report, None) else set())

    def tick(self, now: float) -> None:
        """Notice owners gone, stop meshes that outlived their ttl, forget old sends."""
        for mesh in list(self._meshes.values()):
            self._refresh(mesh, now)
            expired = mesh.ttl_s and now - mesh.unowned_at >= mesh.ttl_s
            if mesh.owner is None and expired and not mesh.stopping:
                self._log.warning("detached_mesh_expired", mesh=mesh.name, ttl_s=mesh.ttl_s)
                self._stop_mesh(mesh, TTL_STOP_GRACE_S)

    # -- owners --------------------------------------------------------------------------------

    def _refresh(self, mesh: DetachedMesh, now: float) -> None:
        """Find out whether the owner of `mesh` is gone; if so, the mesh is unowned now."""
        mesh.forget_recent(now - self._watchdog.owner_timeout_s - 1.0)
        seen = self._watchdog.last_seen(mesh.owner or "")
        if mesh.owner is None or mesh.owner_alive(seen, self._watchdog.owner_timeout_s, now):
            return
        for _, header, payload in mesh.recent:  # the owner may never have read these
            self._keep(mesh, header, payload)
        mesh.recent.clear()
        self._log.warning(
            "detached_mesh_unowned",
            mesh=mesh.name,
            owner=mesh.owner,
            kept=len(mesh.kept),
            reason="its owner is gone; the mesh is kept for a client to adopt",
        )
        self._set_owner(mesh, None, 0, "", now)
        mesh.unowned_since, mesh.unowned_at = time.time(), now

    def _set_owner(
        self, mesh: DetachedMesh, owner: str | None, pid: int, host: str, now: float
    ) -> None:
        mesh.set_owner(owner, pid, host == self._hostname, now)

    # -- registration --------------------------------------------------------------------------

    def _register(self, envelope: Envelope) -> None:
        request: DetachMesh = envelope.header
        why = self._refusal(request)
        if not why:
            now = time.monotonic()
            mesh = DetachedMesh(
                request.name, request.agents, request.spec, request.ttl_s, None, 0, None, now
            )
            self._set_owner(mesh, request.owner, request.owner_pid, request.owner_host, now)
            self._meshes[request.name] = mesh
            for proc_id, rank in zip(request.proc_ids, request.ranks, strict=True):
                self._procs.detached[proc_id] = (request.name, rank)
            self._log.info("detached_mesh_registered", mesh=request.name, owner=request.owner)
        self._send(request.owner, Registered(request.request_id, self._address, why))

    def _refusal(self, request: DetachMesh) -> str:
        if not self._persistent:
            return (
                f"host agent {self._address} ends with the client that started it "
                "(this_host()); detach meshes on agents started with 'meshvisor agent' or by "
                "a job: a persistent allocation"
            )
        if len(request.proc_ids) != len(request.ranks) or not 0 <= request.ttl_s < math.inf:
            return "a DetachMesh needs one rank per proc id and a non-negative ttl_s"
        known = self._meshes.get(request.name)
        if known is not None:
            return (
                f"a detached mesh named {request.name!r} exists already on host agent "
                f"{self._address} ({known.owner_words()}); adopt it, stop it "
                "('meshvisor meshes stop'), or choose another name"
            )
        return ""

    def _add_actors(self, envelope: Envelope) -> None:
        header: DetachActors = envelope.header
        mesh = self._meshes.get(header.name)
        if mesh is None:
            self._log.warning("message_ignored", kind="DetachActors", mesh=header.name)
            return
        mesh.actors[header.actor_id] = header.spec
        self._mesh_of_actors[header.actor_id] = header.name

    # -- failures ------------------------------------------------------------------------------

    def _actor_failed(self, envelope: Envelope) -> None:
        header: ActorFailed = envelope.header
        mesh = self._meshes.get(self._mesh_of_actors.get(header.actor_id, ""))
        if mesh is None:
            self._log.warning("message_ignored", kind="ActorFailed", actor_id=header.actor_id)
            return
        payload = _owned(envelope.payload)
        if self._deliver(mesh, header, payload):
            self._send(mesh.owner or "", header, payload)

    def _reply_lost(self, envelope: Envelope) -> None:
        """An actor of a detached mesh could not send an answer to its caller (its owner is
        this agent): the mesh's owner ends or forwards that call as for its other actors.
        Without an owner, the caller is sent the call's `Failure` (the actor's event) from
        here, and the adopter is told too (it may hold keys this host lacks). A proc's answer
        for an actor it does not know goes to the proc's owner, which does the same."""
        header: ReplyLost = envelope.header
        self._log.warning("reply_lost", call_id=header.call_id, proc=header.proc_id)
        mesh = self._meshes.get(self._procs.detached.get(header.proc_id, ("", 0))[0])
        payload = _owned(envelope.payload)
        proc = self._procs.get(header.proc_id)
        if mesh is None and proc is not None:  # an answer of no actor (unknown there)
            self._send(proc.owner, header, payload)  # its owner ends or forwards that call
        elif mesh is not None and self._deliver(mesh, header, payload):
            self._send(mesh.owner or "", header, payload)
        else:
            self._send(header.reply_to, Failure(header.call_id, header.rank, "failed"), payload)

    def _deliver(self, mesh: DetachedMesh, header: Any, payload: Payload | None) -> bool:
        """Whether a failure goes to the owner now (remembered as sent), else it is kept."""
        now = time.monotonic()
        self._refresh(mesh, now)
        if mesh.owner is not None and not mesh.pending:
            mesh.recent.append((now, header, payload))
            return True
        self._keep(mesh, header, payload)
        return False

    def _keep(self, mesh: DetachedMesh, header: Any, payload: Payload | None) -> None:
        if mesh.keep(header, payload):
            self._log.warning("detached_failure_dropped", mesh=mesh.name, limit=KEPT_LIMIT)
        what = getattr(header, "proc_id", None) or getattr(header, "actor_id", "")
        self._log.warning(
            "detached_failure_kept",
            mesh=mesh.name,
            kind=type(header).__name__,
            of=what,
            reason="no client owns the mesh; kept for the client that adopts it",
        )

    # -- claims and listing --------------------------------------------------------------------

    def _claim(self, envelope: Envelope) -> None:
        claim: ClaimMesh = envelope.header
        mesh = self._meshes.get(claim.name)
        now = time.monotonic()
        why = f"no detached mesh named {claim.name!r} on host agent {self._address}"
        if mesh is not None:
            self._refresh(mesh, now)
            why = self._claim_refusal(mesh, claim)
        answer = MeshClaim(
            claim.request_id,
            self._address,
            self._hostname,
            claim.name,
            why,
            mesh.spec if mesh is not None and not why else b"",
            tuple(mesh.actors.values()) if mesh is not None and not why else (),
            self._proc_states(mesh) if mesh is not None and not why else (),
        )
        if mesh is not None and not why:
            self._grant(mesh, claim, now)
        self._send(claim.owner, answer)

    def _claim_refusal(self, mesh: DetachedMesh, claim: ClaimMesh) -> str:
        if mesh.stopping:
            return f"detached mesh {mesh.name!r} is being stopped"
        if claim.arbiter and mesh.owner not in (None, claim.owner):
            return (
                f"detached mesh {mesh.name!r} is {mesh.owner_words()}: one client owns a "
                "mesh at a time; stop that client (its host agents then see it gone) or "
                "adopt from it"
            )
        return ""

    def _grant(self, mesh: DetachedMesh, claim: ClaimMesh, now: float) -> None:
        self._set_owner(mesh, claim.owner, claim.owner_pid, claim.owner_host, now)
        mesh.pending, mesh.unowned_since = True, 0.0
        mesh.recent.clear()
        for proc_id in self._ids_of(mesh):
            proc = self._procs.get(proc_id)
            if proc is not None:
                proc.owner = claim.owner
        self._log.info("detached_mesh_adopted", mesh=mesh.name, owner=claim.owner)

    def _proc_states(self, mesh: DetachedMesh) -> tuple[DetachedProc, ...]:
        states = []
        for proc_id in self._ids_of(mesh):
            proc = self._procs.get(proc_id)
            address = proc.address if proc is not None and proc.connected else ""
            pid = (proc.pid or 0) if proc is not None else 0
            rank = self._procs.detached[proc_id][1]
            reported = proc_id in mesh.kept_procs
            states.append(DetachedProc(proc_id, rank, address, pid, proc is not None, reported))
        return tuple(states)

    def _claim_done(self, envelope: Envelope) -> None:
        done: ClaimDone = envelope.header
        mesh = self._meshes.get(done.name)
        if mesh is None or mesh.owner != done.owner or not mesh.pending:
            return
        mesh.pending = False
        for header, payload in mesh.take_kept():
            mesh.recent.append((time.monotonic(), header, payload))
            self._send(done.owner, header, payload)

    def _list(self, envelope: Envelope) -> None:
        request: ListDetached = envelope.header
        now = time.monotonic()
        infos = []
        for mesh in self._meshes.values():
            self._refresh(mesh, now)
            ids = self._ids_of(mesh)
            alive = sum(1 for proc_id in ids if proc_id in self._procs)
            infos.append(
                DetachedInfo(
                    mesh.name,
                    mesh.agents,
                    len(ids),
                    alive,
                    mesh.owner or "",
                    mesh.owner_pid,
                    mesh.unowned_since,
                    len(mesh.kept),
                    mesh.ttl_s,
                )
            )
        listing = DetachedListing(request.request_id, self._address, self._hostname, tuple(infos))
        self._send(request.reply_to, listing)

    # -- stopping ------------------------------------------------------------------------------

    def _stop(self, envelope: Envelope) -> None:
        request: StopDetached = envelope.header
        mesh = self._meshes.get(request.name)
        why, count = f"no detached mesh named {request.name!r} here", 0
        if mesh is not None:
            why, count = "", self._stop_mesh(mesh, request.grace_s)
        answer = DetachedStopped(request.request_id, self._address, request.name, count, why)
        self._send(request.reply_to, answer)

    def _stop_mesh(self, mesh: DetachedMesh, grace_s: float) -> int:
        """Stop the running procs of `mesh`; it is forgotten once they are gone."""
        mesh.stopping = True
        running = tuple(proc_id for proc_id in self._ids_of(mesh) if proc_id in self._procs)
        self._log.info("detached_mesh_stopping", mesh=mesh.name, procs=len(running))
        self._stop_procs(running, grace_s)
        if not running:
            self._forget(mesh)
        return len(running)

    def _forget_if_stopped(self, mesh: DetachedMesh, exiting: str) -> None:
        """Forget `mesh` once no proc of it runs and none failed unseen (or it was stopped)."""
        others = [proc_id for proc_id in self._ids_of(mesh) if proc_id != exiting]
        if any(proc_id in self._procs for proc_id in others):
            return
        reports = [self._procs.exit_report(proc_id) for proc_id in others]
        owner_knows = mesh.owner is not None and not mesh.pending and not mesh.kept
        if mesh.stopping or owner_knows or all(r is not None and r.requested for r in reports):
            self._forget(mesh)

    def _forget(self, mesh: DetachedMesh) -> None:
        self._meshes.pop(mesh.name, None)
        for proc_id in self._ids_of(mesh):
            del self._procs.detached[proc_id]
        for actor_id in mesh.actors:
            self._mesh_of_actors.pop(actor_id, None)
        self._set_owner(mesh, None, 0, "", 0.0)
        self._log.info("detached_mesh_stopped", mesh=mesh.name)

    # -- helpers -------------------------------------------------------------------------------

    def _ids_of(self, mesh: DetachedMesh) -> list[str]:
        return [proc_id for proc_id, (name, _) in self._procs.detached.items() if name == mesh.name]

    def _send(self, address: str, header: Any, payload: Payload | None = None) -> None:
        try:
            self._outbox.send(address, encode(header, payload))
        except TransportError as exc:
            self._log.warning("send_failed", to=address, reason=str(exc))


def _owned(payload: Payload | None) -> Payload | None:
    """A copy of a received payload: the frames it came in are not ours to keep."""
    if payload is None:
        return None
    return Payload(bytes(payload.body), [bytes(b) for b in payload.buffers])
