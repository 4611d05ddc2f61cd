"""The messages of detached meshes: proc meshes that outlive their client, kept by their host
agents until a new client adopts them (`mesh/_api/detached.py`, `mesh/_agent/detached.py`).

Owner → agents: DetachMesh (answered by Registered), DetachActors, ClaimDone.
Any client → agents: ListDetached (answered by DetachedListing), ClaimMesh (answered by
MeshClaim), StopDetached (answered by DetachedStopped).
`spec` fields are pickled by the owner for the adopter; agents keep them and never unpickle them.
"""

from __future__ import annotations

from dataclasses import dataclass

from transport import message_type


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class DetachMesh:
    """Owner → each agent of a new detached mesh, before its procs: keep procs `proc_ids` (at
    `ranks`) as mesh `name` when the owner goes away. The first of `agents` arbitrates names
    and adoption. `ttl_s`: stop it after that long without an owner (0: never)."""

    request_id: int
    name: str
    owner: str
    owner_pid: int
    owner_host: str
    agents: tuple[str, ...]
    proc_ids: tuple[str, ...]
    ranks: tuple[int, ...]
    spec: bytes
    ttl_s: float
    arbiter: bool


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class Registered:
    """Agent → owner: the answer to `DetachMesh`; `why` says why it was refused ("" if not)."""

    request_id: int
    agent: str
    why: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class DetachActors:
    """Owner → the agents of detached mesh `name`: an actor mesh `actor_id` was spawned on it
    (its failures come to the agents, which forward or keep them)."""

    name: str
    actor_id: str
    spec: bytes


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ListDetached:
    request_id: int
    reply_to: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class DetachedInfo:
    """One detached mesh as one agent sees it. `unowned_since`: unix time, 0 while owned."""

    name: str
    agents: tuple[str, ...]
    procs: int
    alive: int
    owner: str
    owner_pid: int
    unowned_since: float
    kept: int
    ttl_s: float


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class DetachedListing:
    request_id: int
    agent: str
    host: str
    meshes: tuple[DetachedInfo, ...]


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ClaimMesh:
    """Client → the agents of detached mesh `name`, the arbiter (its first agent) first: make
    `owner` its owner. The arbiter refuses while another owner is alive."""

    request_id: int
    name: str
    owner: str
    owner_pid: int
    owner_host: str
    arbiter: bool


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class DetachedProc:
    """One proc of a claimed mesh on the answering agent. `address` is "" once it is gone;
    `reported`: a failure of it was kept and follows `ClaimDone`."""

    proc_id: str
    rank: int
    address: str
    pid: int
    alive: bool
    reported: bool


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class MeshClaim:
    """Agent → claimer: `why` is "" when granted, else why not (naming the owner)."""

    request_id: int
    agent: str
    host: str
    name: str
    why: str
    spec: bytes
    actors: tuple[bytes, ...]
    procs: tuple[DetachedProc, ...]


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ClaimDone:
    """New owner → agents: it knows the procs now; send it the failures kept meanwhile."""

    name: str
    owner: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class StopDetached:
    request_id: int
    reply_to: str
    name: str
    grace_s: float


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class DetachedStopped:
    """Agent → whoever asked: `procs` of mesh `name` are being stopped ("" `why`), or why not."""

    request_id: int
    agent: str
    name: str
    procs: int
    why: str
