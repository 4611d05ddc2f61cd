"""The JSON form of a snapshot (``meshvisor top --json``), schema ``meshvisor.top/1``.

Documented in docs/live-view.md; a new field may be added, none renamed or removed, without a
new schema version.
"""

from __future__ import annotations

from typing import Any

from mesh import Extent
from mesh.tooling import ActorView, EventView, HostSnapshot, ProcView
from observe._snapshot import Snapshot

SCHEMA = "meshvisor.top/1"


def snapshot_json(snapshot: Snapshot) -> dict[str, Any]:
    """`snapshot` as plain JSON values."""
    return {
        "schema": SCHEMA,
        "target": snapshot.title,
        "time": snapshot.time,
        "hosts": [_host(host) for host in snapshot.hosts],
        "unreachable": [{"agent": u.agent, "reason": u.reason} for u in snapshot.unreachable],
    }


def point_of(labels: tuple[str, ...], sizes: tuple[int, ...], rank: int) -> dict[str, int]:
    """The coordinates of `rank` in a mesh of `labels` and `sizes` (empty if they disagree)."""
    try:
        return dict(Extent(labels, sizes).point(rank))
    except (ValueError, IndexError):
        return {}


def _host(host: HostSnapshot) -> dict[str, Any]:
    return {
        "host": host.host,
        "agent": host.agent,
        "agent_pid": host.agent_pid,
        "agent_started": host.agent_started,
        "time": host.time,
        "procs": [_proc(proc) for proc in host.procs],
        "events": [_event(event) for event in host.events],
    }


def _proc(proc: ProcView) -> dict[str, Any]:
    return {
        "proc_id": proc.proc_id,
        "mesh": proc.mesh_name,
        "point": point_of(proc.labels, proc.sizes, proc.rank),
        "rank": proc.rank,
        "owner": proc.owner,
        "pid": proc.pid,
        "health": proc.health,
        "cpu_percent": proc.cpu_percent,
        "rss_bytes": proc.rss_bytes,
        "restarts": proc.restarts,
        "started": proc.started,
        "ended": proc.ended,
        "exit": proc.exit or None,
        "actors": [_actor(actor) for actor in proc.actors],
    }


def _actor(actor: ActorView) -> dict[str, Any]:
    return {
        "mesh": actor.mesh_name,
        "actor_id": actor.actor_id,
        "point": point_of(actor.labels, actor.sizes, actor.rank),
        "rank": actor.rank,
        "restarts": actor.restart_count,
        "state": actor.state,
        "message": actor.message or None,
    }


def _event(event: EventView) -> dict[str, Any]:
    return {
        "time": event.time,
        "kind": event.kind,
        "proc_id": event.proc_id,
        "mesh": event.mesh_name,
        "rank": event.rank,
        "pid": event.pid,
        "message": event.message,
    }
