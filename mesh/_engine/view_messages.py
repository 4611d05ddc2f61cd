"""The messages of the live view (``meshvisor top``): a read-only snapshot of a host agent.

Viewer → agent: SnapshotQuery; agent → viewer: HostSnapshot (its procs, their actors and its
last events), sent to the query's `reply_to` only. Proc → agent: ProcActors, the actors a proc
hosts, sent when they change. Every field is a plain value: a snapshot is a header, decoded
without pickle, so a viewer never runs anything an agent sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from transport import message_type


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class SnapshotQuery:
    """Viewer → agent: send a `HostSnapshot` tagged `query_id` to `reply_to`. The agent
    records nothing about the viewer: it owns, watches and may stop nothing."""

    reply_to: str
    query_id: int


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ActorView:
    """One actor as its proc reports it: its mesh, point, restart count and state
    (starting, running, failed, stopped), with why it failed."""

    mesh_name: str
    actor_id: str
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    rank: int
    restart_count: int
    state: str
    message: str = ""


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ProcActors:
    """Proc → agent: the actors proc `proc_id` hosts now (sent when that changes)."""

    proc_id: str
    actors: tuple[ActorView, ...]


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ProcView:
    """One proc of an agent: where it sits in its proc mesh, who owns it, its health
    (starting, running, hung, stopping, failed, stopped), its process's CPU share (percent of
    one core, None before there are two samples) and resident memory, its restarts (how many
    procs it replaces in a chain), its actors, and how it ended (`ended`, wall time) if it did."""

    proc_id: str
    mesh_name: str
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    rank: int
    owner: str
    pid: int | None
    health: str
    cpu_percent: float | None
    rss_bytes: int | None
    restarts: int
    started: float
    ended: float | None
    exit: str
    actors: tuple[ActorView, ...]


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class EventView:
    """Something the agent saw happen to a proc or an actor, at wall time `time`."""

    time: float
    kind: str
    proc_id: str
    mesh_name: str
    rank: int
    pid: int | None
    message: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class HostSnapshot:
    """Agent → viewer: the answer to the `SnapshotQuery` `query_id`: the agent (host, address,
    pid, since when it runs, wall time of the snapshot), its procs, live first, then those
    that ended lately, and its last events, oldest first."""

    query_id: int
    host: str
    agent: str
    agent_pid: int
    agent_started: float
    time: float
    procs: tuple[ProcView, ...]
    events: tuple[EventView, ...]
