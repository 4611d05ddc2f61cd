"""How a snapshot looks in the terminal: hosts → procs → actors, then the last events (rich).

One table per host: a row per proc (its mesh and point, id, pid, health, CPU, memory,
restarts, owner) with a row under it per actor it hosts; then the events of every host merged
in time order, the latest last; agents that did not answer are named in red with the reason.
"""

from __future__ import annotations

import datetime
import os
from collections import Counter
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from mesh.tooling import EventView, HostSnapshot, ProcView
from observe._json_form import point_of
from observe._snapshot import Snapshot

#: The style of each health (procs) and state (actors).
HEALTH_STYLES = {
    "running": "green",
    "starting": "cyan",
    "stopping": "yellow",
    "hung": "bold magenta",
    "failed": "bold red",
    "stopped": "dim",
}


def render(snapshot: Snapshot, events: int = 10, help_line: str = "") -> RenderableType:
    """The whole screen for `snapshot`, with at most `events` last events."""
    parts: list[RenderableType] = [_title(snapshot, help_line)]
    for unreachable in snapshot.unreachable:
        parts.append(Text(f"unreachable {unreachable.agent}: {unreachable.reason}", "bold red"))
    parts.extend(_host_table(host) for host in snapshot.hosts)
    if events > 0:
        parts.append(_events_table(snapshot, events))
    return Group(*parts)


def _title(snapshot: Snapshot, help_line: str) -> Text:
    procs = [proc for host in snapshot.hosts for proc in host.procs]
    counts = Counter(proc.health for proc in procs)
    health = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    clock = _clock(snapshot.time)
    text = Text(f"meshvisor top: {snapshot.title}", "bold")
    hosts = _count(len(snapshot.hosts), "host")
    text.append(f"  {hosts}, {_count(len(procs), 'proc')} ({health or 'none'})  {clock}")
    if help_line:
        text.append(f"  {help_line}", "dim")
    return text


#: Column widths that keep what identifies a proc (pid, proc id) on screen however long the
#: reasons a proc ended are: those are cut with an ellipsis (`--json` has them whole).
_COLUMN_LAYOUT: dict[str, dict[str, Any]] = {
    "PROC": {"no_wrap": True, "min_width": 12},
    "PID": {"no_wrap": True, "min_width": 7},
    "HEALTH": {"no_wrap": True, "max_width": 48, "overflow": "ellipsis"},
    "OWNER": {"overflow": "fold"},
}


def _host_table(host: HostSnapshot) -> Table:
    uptime = _duration(host.time - host.agent_started)
    table = Table(
        title=f"host {host.host}  agent {host.agent} (pid {host.agent_pid}, up {uptime})",
        title_justify="left",
    )
    for column in ("MESH / ACTORS", "PROC", "PID", "HEALTH", "CPU%", "MEM", "RESTARTS", "OWNER"):
        table.add_column(column, **_COLUMN_LAYOUT.get(column, {"no_wrap": True}))
    for proc in host.procs:
        table.add_row(*_proc_cells(proc))
        for actor in proc.actors:
            point = _point_text(point_of(actor.labels, actor.sizes, actor.rank))
            state = Text(actor.state, HEALTH_STYLES.get(actor.state, ""))
            if actor.message:
                state.append(f" {actor.message}", "red")
            restarts = str(actor.restart_count) if actor.restart_count else ""
            table.add_row(f"  └ {actor.mesh_name}{point}", "", "", state, "", "", restarts, "")
    if not host.procs:
        table.add_row(Text("no procs", "dim"), *[""] * 7)
    return table


def _proc_cells(proc: ProcView) -> tuple[str | Text, ...]:
    health = Text(proc.health, HEALTH_STYLES.get(proc.health, ""))
    if proc.exit:
        health.append(f" {proc.exit}", "dim" if proc.health == "stopped" else "red")
    cpu = f"{proc.cpu_percent:.1f}" if proc.cpu_percent is not None else ""
    return (
        f"{proc.mesh_name}{_point_text(point_of(proc.labels, proc.sizes, proc.rank))}",
        proc.proc_id,
        str(proc.pid) if proc.pid is not None else "",
        health,
        cpu,
        _size(proc.rss_bytes),
        str(proc.restarts),
        _owner(proc.owner),
    )


def _events_table(snapshot: Snapshot, limit: int) -> Table:
    table = Table(title="last events", title_justify="left")
    for column in ("TIME", "HOST", "WHERE", "PID", "WHAT"):
        table.add_column(column, no_wrap=column != "WHAT", overflow="fold")
    merged: list[tuple[EventView, HostSnapshot]] = [
        (event, host) for host in snapshot.hosts for event in host.events
    ]
    merged.sort(key=lambda pair: pair[0].time)
    for event, host in merged[-limit:]:
        style = _event_style(event.kind)
        table.add_row(
            _clock(event.time),
            host.host,
            _event_where(event, host),
            str(event.pid) if event.pid is not None else "",
            Text(event.message, style),
        )
    return table


def _event_where(event: EventView, host: HostSnapshot) -> str:
    proc = next((p for p in host.procs if p.proc_id == event.proc_id), None)
    if proc is None:
        return f"{event.mesh_name}[{event.rank}]"
    return f"{event.mesh_name}{_point_text(point_of(proc.labels, proc.sizes, event.rank))}"


def _event_style(kind: str) -> str:
    if kind in ("failed", "actor_failed"):
        return "red"
    if kind == "hung":
        return "magenta"
    return "dim" if kind in ("stopped", "actor_stopped") else ""


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _point_text(point: dict[str, int]) -> str:
    return "{" + ",".join(f"{label}={index}" for label, index in point.items()) + "}"


def _owner(owner: str) -> str:
    """The owner's address, as the client's pid when it is a local client's run directory."""
    if owner.startswith("ipc://"):
        try:
            with open(os.path.join(os.path.dirname(owner[len("ipc://") :]), "owner.pid")) as f:
                return f"client pid {int(f.read().strip())}"
        except (OSError, ValueError):
            pass
    return owner


def _size(rss: int | None) -> str:
    if rss is None:
        return ""
    amount = float(rss)
    for unit in ("B", "K", "M"):
        if amount < 1024:
            return f"{amount:.0f}{unit}" if unit == "B" else f"{amount:.1f}{unit}"
        amount /= 1024
    return f"{amount:.1f}G"


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def _clock(at: float) -> str:
    return datetime.datetime.fromtimestamp(at).strftime("%H:%M:%S")
