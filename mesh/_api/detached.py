"""Detached meshes: proc meshes (with their actor meshes) that outlive the client that spawned
them, kept by their host agents until a new client adopts them by name.

`register_detached` tells the agents before the procs start; `adopt` claims a mesh (its first
agent arbitrates: one owner at a time) and rebuilds the handles here: same procs, same actors,
nothing restarted; the failures the agents kept meanwhile follow. See docs/detached-meshes.md.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import time
from dataclasses import dataclass
from typing import Any

from mesh._api.actor_mesh import ActorMesh, ActorMeshState
from mesh._engine.detached_messages import (
    ClaimDone,
    ClaimMesh,
    DetachActors,
    DetachedInfo,
    DetachMesh,
    ListDetached,
    MeshClaim,
    StopDetached,
)
from mesh._engine.notebook import in_notebook
from mesh._engine.ownership import ActorMeshRecord, FailureHandler, ProcMeshRecord
from mesh._engine.peers import ProcPeer
from mesh._engine.runtime import Runtime
from mesh._shape import Extent, Region
from supervision import RestartPolicy, SupervisionError
from transport import MAX_HEADER_BYTES, Payload, dumps, loads

#: How long a client waits for host agents to answer about detached meshes.
ANSWER_TIMEOUT_S = 10.0
#: The largest description of an actor mesh (class and constructor arguments) agents keep.
MAX_SPEC_BYTES = MAX_HEADER_BYTES // 4


class AdoptionError(RuntimeError):
    """A detached mesh cannot be adopted (another client owns it, or it is being stopped)."""


@dataclass(frozen=True)
class DetachedMeshInfo:
    """A detached mesh as its host agents see it: `owner` is the owning client's address
    ("" when none), `unowned_since` a unix time (None while owned)."""

    name: str
    hosts: tuple[str, ...]
    procs: int
    alive: int
    owner: str
    owner_pid: int
    unowned_since: float | None
    kept_failures: int
    ttl_s: float | None

    def owner_words(self) -> str:
        if self.owner:
            return f"{self.owner} (pid {self.owner_pid})"
        if self.unowned_since is None:
            return "unowned"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.unowned_since))
        return f"unowned since {stamp}"


@dataclass(frozen=True)
class _MeshSpec:
    """What an adopter needs to rebuild a proc mesh's record (pickled, opaque to agents)."""

    key: str
    extent: Extent
    env: tuple[tuple[str, str], ...]
    heartbeats: tuple[float, float, float]
    bootstrap: tuple[str, ...]
    setup: bytes
    restart: RestartPolicy | None


@dataclass(frozen=True)
class _ActorSpec:
    """What an adopter needs to call (and rebuild) an actor mesh of a detached proc mesh."""

    name: str
    actor_id: str
    actor_class: type
    arguments: tuple[tuple[Any, ...], dict[str, Any]]
    extent: Extent
    ranks: tuple[int, ...]  # the proc mesh's ranks its actors live on


def register_detached(
    runtime: Runtime, record: ProcMeshRecord, restart: RestartPolicy | None, ttl_s: float
) -> None:
    """Tell the agents of `record` (not launched yet) to keep it when this process goes away;
    ValueError if its name is taken (the first agent decides) or an agent refuses."""
    agents = list(dict.fromkeys(peer.agent for peer in record.peers if peer.agent is not None))
    spec = _blob(
        _MeshSpec(
            record.key,
            record.extent,
            record.env,
            (record.heartbeat_interval_s, record.heartbeat_timeout_s, record.busy_timeout_s),
            record.bootstrap,
            record.setup,
            restart,
        )
    )

    if len(spec) > MAX_SPEC_BYTES:
        raise ValueError(
            f"cannot detach proc mesh {record.name!r}: its environment and bootstrap take "
            f"{len(spec)} bytes, over the {MAX_SPEC_BYTES} bytes its host agents keep for "
            "adopters"
        )

    def request(agent: str) -> Any:
        mine = [(p.proc_id, rank) for rank, p in enumerate(record.peers) if p.agent == agent]
        return lambda request_id, reply_to: DetachMesh(
            request_id,
            record.name,
            reply_to,
            os.getpid(),
            runtime.hostname,
            tuple(agents),
            tuple(proc_id for proc_id, _ in mine),
            tuple(rank for _, rank in mine),
            spec,
            ttl_s,
            agent == agents[0],
        )

    runtime.agents.keep_alive(agents)  # network agents must hear this owner lives
    done: list[str] = []
    for group in (agents[:1], agents[1:]):
        futures = {agent: runtime.queries.send(agent, request(agent)) for agent in group}
        answers = runtime.queries.collect(futures, ANSWER_TIMEOUT_S)
        done += [agent for agent, answer in answers.items() if not answer.why]
        refused = [answer.why for answer in answers.values() if answer.why]
        if refused:
            _unregister(runtime, done, record.name)
            raise ValueError(f"cannot detach proc mesh {record.name!r}: {refused[0]}")


def _unregister(runtime: Runtime, agents: list[str], name: str) -> None:
    """Undo a registration that other agents refused (its procs never started)."""
    for agent in agents:
        runtime.send_message(agent, StopDetached(0, runtime.address_for(agent), name, 0.0))


def announce_actors(
    runtime: Runtime,
    record: ProcMeshRecord,
    actors: ActorMeshRecord,
    arguments: tuple[tuple[Any, ...], dict[str, Any]],
) -> None:
    """Tell the agents of detached `record` of a new actor mesh on it, for its adopters."""
    assert actors.actor_class is not None
    ranks = tuple(record.peers.index(peer) for peer in actors.peers)
    spec = _blob(
        _ActorSpec(
            actors.name, actors.actor_id, actors.actor_class, arguments, actors.extent, ranks
        )
    )
    if len(spec) > MAX_SPEC_BYTES:
        raise ValueError(
            f"cannot spawn actor mesh {actors.name!r} on detached proc mesh {record.detached!r}: "
            f"its class and constructor arguments take {len(spec)} bytes, over the "
            f"{MAX_SPEC_BYTES} bytes its host agents keep for adopters; pass large data "
            "another way (a file, or a call after spawning)"
        )
    for agent in dict.fromkeys(peer.agent for peer in actors.peers if peer.agent is not None):
        runtime.send_message(agent, DetachActors(record.detached, actors.actor_id, spec))


def list_detached(
    runtime: Runtime, agents: list[str], *, partial: bool = False
) -> list[DetachedMeshInfo]:
    """The detached meshes of these host agents, by name (with `partial`, of those that
    answer: a lost host does not hide the meshes of the others)."""
    futures = {
        agent: runtime.queries.send(agent, lambda i, reply_to: ListDetached(i, reply_to))
        for agent in agents
    }
    listings = runtime.queries.collect(futures, ANSWER_TIMEOUT_S, partial=partial)
    by_name: dict[str, list[DetachedInfo]] = {}
    for listing in listings.values():
        for info in listing.meshes:
            by_name.setdefault(info.name, []).append(info)
    return [_merged(infos) for _, infos in sorted(by_name.items())]


def _merged(infos: list[DetachedInfo]) -> DetachedMeshInfo:
    """One mesh from what each of its agents says of it."""
    first = infos[0]
    owned = next((i for i in infos if i.owner), None)
    unowned = [i.unowned_since for i in infos if i.unowned_since]
    return DetachedMeshInfo(
        first.name,
        first.agents,
        sum(i.procs for i in infos),
        sum(i.alive for i in infos),
        owned.owner if owned is not None else "",
        owned.owner_pid if owned is not None else 0,
        min(unowned) if unowned and owned is None else None,
        sum(i.kept for i in infos),
        first.ttl_s or None,
    )


def stop_detached(runtime: Runtime, agents: list[str], name: str, grace_s: float) -> int:
    """Stop detached mesh `name` on these agents (whoever owns it); how many procs were
    running. LookupError if none of them knows it."""
    answers = runtime.queries.ask(
        agents,
        lambda request_id, reply_to: StopDetached(request_id, reply_to, name, grace_s),
        ANSWER_TIMEOUT_S,
    )
    if all(answer.why for answer in answers.values()):
        raise LookupError(f"no detached mesh named {name!r} on host agents {agents}")
    return sum(answer.procs for answer in answers.values())


def adopt(
    runtime: Runtime, agents: list[str], name: str, on_failure: FailureHandler | None
) -> tuple[ProcMeshRecord, list[ActorMeshRecord]]:
    """Claim detached mesh `name` from the agents that keep it and rebuild its records here;
    LookupError if no agent knows it, AdoptionError if another client owns it."""
    known = [info for info in list_detached(runtime, agents, partial=True) if info.name == name]
    if not known:
        raise LookupError(
            f"no detached mesh named {name!r} on host agents {agents}; see them with "
            "'meshvisor meshes list'"
        )
    order = list(known[0].hosts)
    runtime.agents.keep_alive(order)
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while True:  # claiming again is granted to the owner: until every proc is up
        answers = _claim_all(runtime, order, name)
        starting = [
            p.proc_id for a in answers.values() for p in a.procs if p.alive and not p.address
        ]
        if not starting:
            break
        if time.monotonic() > deadline:
            raise AdoptionError(
                f"cannot adopt detached mesh {name!r}: its procs {starting} are still "
                f"starting after {ANSWER_TIMEOUT_S:g} s; adopt it again once they are up"
            )
        time.sleep(0.05)
    record, actor_records = _rebuild(runtime, name, answers, order[0], on_failure)
    for agent in order:  # the failures they kept come next, now that the procs are known
        runtime.send_message(agent, ClaimDone(name, runtime.address_for(agent)))
    if in_notebook():  # the procs' lines come here, as they do for meshes spawned here
        record.forward_output = True
        switched = runtime.output.sync(list(record.peers), forward=True)
        # Wait for the switch: a line printed by the adopter's first call could otherwise
        # reach the fork server before it, and go to the old owner. A slow agent only
        # costs lines, not the adoption.
        with contextlib.suppress(TimeoutError):
            switched.get()
    return record, actor_records


def _claim_all(runtime: Runtime, order: list[str], name: str) -> dict[str, MeshClaim]:
    """Claim mesh `name` from its agents, the arbiter first; AdoptionError if refused."""
    answers: dict[str, MeshClaim] = {}
    for group, arbiter in ((order[:1], True), (order[1:], False)):
        answers |= runtime.queries.ask(group, _claim(runtime, name, arbiter), ANSWER_TIMEOUT_S)
        refused = [answer.why for answer in answers.values() if answer.why]
        if refused:
            raise AdoptionError(f"cannot adopt detached mesh {name!r}: {refused[0]}")
    return answers


def _claim(runtime: Runtime, name: str, arbiter: bool) -> Any:
    return lambda request_id, reply_to: ClaimMesh(
        request_id, name, reply_to, os.getpid(), runtime.hostname, arbiter
    )


def _rebuild(
    runtime: Runtime,
    name: str,
    answers: dict[str, MeshClaim],
    arbiter: str,
    on_failure: FailureHandler | None,
) -> tuple[ProcMeshRecord, list[ActorMeshRecord]]:
    spec: _MeshSpec = _unblob(answers[arbiter].spec)
    states = {
        state.rank: (agent, state, answers[agent].host)
        for agent in answers
        for state in answers[agent].procs
    }
    missing = [rank for rank in range(spec.extent.nelements) if rank not in states]
    if missing:
        raise AdoptionError(f"detached mesh {name!r}: no host agent knows its ranks {missing}")
    peers = []
    for rank, point in enumerate(spec.extent.points()):
        agent, state, host = states[rank]
        peer = ProcPeer(
            state.proc_id, name, point, agent, state.address or None, mesh_key=spec.key, owned=True
        )
        peer.pid, peer.host = (state.pid or None), host
        if not state.alive and not state.reported:
            _mark_ended(peer)
        peers.append(runtime.ownership.add_peer(peer))
    record = ProcMeshRecord(spec.key, name, spec.extent, tuple(peers), spec.env, *spec.heartbeats)
    record.bootstrap, record.setup, record.detached = spec.bootstrap, spec.setup, name
    record.generation = _generation([peer.proc_id for peer in peers])
    runtime.ownership.add_proc_mesh(record, spec.restart)
    if on_failure is not None:
        runtime.ownership.set_handler(spec.key, on_failure)
    actor_records = [
        _actor_record(runtime, _unblob(blob), record) for blob in answers[arbiter].actors
    ]
    return record, actor_records


def _actor_record(runtime: Runtime, spec: _ActorSpec, mesh: ProcMeshRecord) -> ActorMeshRecord:
    args, kwargs = spec.arguments
    payload = Payload.dump((spec.actor_class, args, kwargs))
    peers = tuple(mesh.peers[rank] for rank in spec.ranks)
    record = ActorMeshRecord(spec.actor_id, spec.name, payload, spec.extent, peers, None)
    record.detached, record.actor_class = True, spec.actor_class
    runtime.ownership.add_actor_mesh(record)
    return record


def _mark_ended(peer: ProcPeer) -> None:
    """A proc that ended while its mesh had an owner (who was told): failed, no news here."""
    event = peer.make_event("exit", "it ended before this client adopted its mesh")
    peer.state, peer.event = "failed", event
    peer.ready.set_exception(SupervisionError(event))
    peer.gone.set_result(None)


def _generation(proc_ids: list[str]) -> int:
    """The restart generation of a mesh with these proc ids (re-spawns are named -rN)."""
    found = [re.search(r"-r(\d+)$", proc_id) for proc_id in proc_ids]
    return max([int(m.group(1)) + 1 for m in found if m is not None], default=1)


def actor_mesh_handle(runtime: Runtime, record: ActorMeshRecord) -> ActorMesh[Any]:
    """A handle to the actor mesh of `record` (spawned or adopted here)."""
    assert record.actor_class is not None
    state = ActorMeshState(
        record.name, record.actor_id, record.actor_class, record.peers, record.extent
    )
    return ActorMesh(runtime, state, Region.full(record.extent))


def _blob(value: Any) -> bytes:
    """`value` serialized as the transport does (large buffers out of band), in one piece
    that agents can keep as bytes."""
    body, buffers = dumps(value)
    return pickle.dumps((body, [bytes(buffer) for buffer in buffers]), protocol=5)


def _unblob(blob: bytes) -> Any:
    body, buffers = pickle.loads(blob)
    return loads(body, buffers)
