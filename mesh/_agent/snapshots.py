"""`AgentView`: the host agent's answers to observers, read-only: the live view
(``meshvisor top``) and the debugger's front end looking for procs (`ListProcs`).

A viewer sends a `SnapshotQuery`; the agent answers with a `HostSnapshot` built from its proc
table, the actors its procs reported (`ProcActors`, sent when they change) and ``/proc`` (CPU
and memory of each live proc), to the query's `reply_to` only, over a connection it does not
keep. It records nothing about the viewer: answering grants no ownership, no watch, and no way
to stop or reach a proc. CPU and memory come from the ``/proc`` sample the agent takes at each
heartbeat anyway: a snapshot reads ``/proc`` only for a proc it sees the first time.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

from mesh._agent.liveness import CpuSample, sample_cpu
from mesh._agent.proc_listing import ListProcs, listed_procs
from mesh._agent.procs import ProcRecord, ProcTable
from mesh._engine.messages import ProcExited
from mesh._engine.view_messages import (
    ActorView,
    EventView,
    HostSnapshot,
    ProcActors,
    ProcView,
    SnapshotQuery,
)
from transport import Outbox, TransportError, encode, is_address

#: The last events a snapshot carries, and the actor events the agent keeps for them.
MAX_EVENTS = 50
#: A CPU share needs two samples at least this far apart (seconds).
_MIN_CPU_INTERVAL_S = 0.05


class AgentView:
    """Answers snapshot queries from the agent's `ProcTable`; keeps what procs report of their
    actors (on their records) and the actor events of late."""

    def __init__(self, procs: ProcTable, outbox: Outbox, host: str, address: str, log: Any):
        self._procs = procs
        self._outbox = outbox
        self._host = host
        self._address = address
        self._log = log
        self._started = time.time()
        #: pid -> (CPU seconds, monotonic time) of its sample in the previous snapshot, and the
        #: share of a core it used up to then
        self._cpu: dict[int, tuple[float, float, float | None]] = {}
        self._actor_events: deque[EventView] = deque(maxlen=MAX_EVENTS)

    def handle(self, header: object) -> bool:
        """Act on `header` if it is a message of the live view; whether it was one."""
        if type(header) is SnapshotQuery:
            self._reply(header.reply_to, "SnapshotQuery", self.snapshot(header.query_id))
        elif type(header) is ListProcs:  # a debugger front end looks for paused calls
            self._reply(header.reply_to, "ListProcs", listed_procs(self._procs, self._host))
        elif type(header) is ProcActors:
            self._on_actors(header)
        else:
            return False
        return True

    def snapshot(self, query_id: int = 0) -> HostSnapshot:
        """What this agent runs now, what ended lately and its last events."""
        now = time.monotonic()
        live = [self._live_view(proc, now) for proc in self._procs]
        live_pids = {proc.pid for proc in self._procs}
        self._cpu = {pid: seen for pid, seen in self._cpu.items() if pid in live_pids}
        ended = [_ended_view(proc) for proc in reversed(self._procs.ended)]
        return HostSnapshot(
            query_id,
            self._host,
            self._address,
            os.getpid(),
            self._started,
            time.time(),
            (*live, *ended),
            self._events(),
        )

    def _reply(self, reply_to: str, kind: str, answer: object) -> None:
        """Answer a read-only query over a connection closed at once: nothing of the asker
        is kept."""
        if not is_address(reply_to):
            self._log.warning("message_rejected", kind=kind, reason="bad reply_to")
            return
        try:
            self._outbox.send_once(reply_to, encode(answer))
        except TransportError as error:
            self._log.warning("answer_not_sent", kind=kind, to=reply_to, reason=str(error))

    def _on_actors(self, report: ProcActors) -> None:
        """A proc's actors changed: keep them, and the changes worth an event."""
        proc = self._procs.get(report.proc_id)
        if proc is None:
            return
        before = {actor.actor_id: actor for actor in proc.actors}
        proc.actors = report.actors
        for actor in report.actors:
            old = before.get(actor.actor_id)
            if old is None or old.state != actor.state:
                self._actor_event(proc, actor)

    def _actor_event(self, proc: ProcRecord, actor: ActorView) -> None:
        what = {
            "running": "started" if actor.restart_count == 0 else "restarted",
            "failed": "failed",
            "stopped": "stopped",
        }.get(actor.state)
        if what is None:
            return
        message = f"actor {actor.mesh_name} {what}"
        if actor.restart_count:
            message += f" (restart {actor.restart_count})"
        if actor.message:
            message += f": {actor.message}"
        kind, rank = f"actor_{what}", actor.rank
        self._actor_events.append(
            EventView(time.time(), kind, proc.proc_id, actor.mesh_name, rank, proc.pid, message)
        )

    def _live_view(self, proc: ProcRecord, now: float) -> ProcView:
        cpu_percent, sample = self._cpu_share(proc, now)
        health = _live_health(proc, now, sample is not None and sample.stopped)
        rss = sample.rss_bytes if sample is not None else None
        return _proc_view(proc, health, cpu_percent, rss, "")

    def _cpu_share(self, proc: ProcRecord, now: float) -> tuple[float | None, CpuSample | None]:
        """The share of a core `proc` used since this agent's previous snapshot of it, and its
        latest sample: the one its last heartbeat took (``/proc`` is read here only the first
        time, or when there is none)."""
        if proc.pid is None:
            return None, None
        latest, at = proc.cpu, proc.cpu_at
        before = self._cpu.get(proc.pid)
        if before is None or latest is None:
            if before is None and latest is not None:
                before = (latest.cpu_s, at, None)
            latest, at = sample_cpu(proc.pid), now
        if latest is None:
            return None, None
        share = before[2] if before is not None else None  # no newer sample: the last share
        if before is not None and at - before[1] >= _MIN_CPU_INTERVAL_S:
            share = round(100.0 * (latest.cpu_s - before[0]) / (at - before[1]), 1)
        if before is None or at != before[1]:
            self._cpu[proc.pid] = (latest.cpu_s, at, share)
        return share, latest

    def _events(self) -> tuple[EventView, ...]:
        """The last events: procs started and ended, actors started, failed, stopped."""
        events = list(self._actor_events)
        for proc in (*self._procs, *self._procs.ended):
            events.append(_event(proc, proc.started, "spawned", _spawned_text(proc)))
            if proc.ended is not None:
                health, text = _how_it_ended(proc)
                events.append(_event(proc, proc.ended, health, text))
        events.sort(key=lambda event: event.time)
        return tuple(events[-MAX_EVENTS:])


def _live_health(proc: ProcRecord, now: float, stopped: bool) -> str:
    """starting, running, stopping or hung (its heartbeats are late, or it is stopped)."""
    if proc.stop_requested:
        return "stopping"
    if proc.pid is not None and (stopped or (proc.connected and proc.heartbeat_due < now)):
        return "hung"
    return "running" if proc.connected else "starting"


def _how_it_ended(proc: ProcRecord) -> tuple[str, str]:
    """(health, a sentence) of a proc that ended: stopped, hung (killed as such) or failed
    (out of memory, killed, or exited)."""
    report: ProcExited | None = proc.report
    if proc.failure is not None:
        return "failed", f"failed to start: {proc.failure.splitlines()[0][:200]}"
    if report is None:
        return "failed", "ended"
    if report.hung:
        return "hung", f"hung, killed: {report.why_hung}"
    if report.out_of_memory:
        return "failed", f"out of memory: {report.out_of_memory.splitlines()[0][:200]}"
    how = f"killed by {report.signal}" if report.signal else f"exited with code {report.exit_code}"
    if report.requested:
        return "stopped", f"stopped ({how})"
    return "failed", how if report.exit_code != 0 else "exited with code 0 unasked"


def _spawned_text(proc: ProcRecord) -> str:
    if proc.spec.replaces:
        return f"spawned, replacing {proc.spec.replaces} (restart {proc.restarts})"
    return "spawned"


def _event(proc: ProcRecord, at: float, kind: str, message: str) -> EventView:
    return EventView(at, kind, proc.proc_id, proc.spec.mesh_name, proc.spec.rank, proc.pid, message)


def _ended_view(proc: ProcRecord) -> ProcView:
    health, text = _how_it_ended(proc)
    return _proc_view(proc, health, None, None, text)


def _proc_view(
    proc: ProcRecord, health: str, cpu_percent: float | None, rss: int | None, exit_text: str
) -> ProcView:
    spec = proc.spec
    return ProcView(
        spec.proc_id,
        spec.mesh_name,
        spec.labels,
        spec.sizes,
        spec.rank,
        proc.owner,
        proc.pid,
        health,
        cpu_percent,
        rss,
        proc.restarts,
        proc.started,
        proc.ended,
        exit_text,
        proc.actors,
    )
