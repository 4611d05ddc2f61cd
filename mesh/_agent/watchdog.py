"""The host agent's deadlines: procs' heartbeats, network owners' signs of life, and the
agent's own pauses, which must not count as its procs' silence.

A proc that misses its heartbeats is judged with `liveness`: hung (kill it), or busy (it gets
time, up to its busy limit). A network owner silent for `owner_timeout_s` is gone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from mesh._agent.liveness import CpuSample, OwnWaits, gone, progressed, sample_cpu
from mesh._agent.procs import ProcRecord, ProcTable

#: A serve loop this much later than it planned means the agent itself was paused.
_PAUSE_S = 0.5
#: The least waiting for a core by the agent that gives a silent proc more time (less is noise).
_MIN_SLACK_S = 0.05
#: The most time a silent proc is given for the agent's waiting, in heartbeat timeouts: a
#: hung proc on a starved host is still found within (1 + this) timeouts.
_MOST_SLACK = 2.0
#: The least time a silent proc is given for the agent's waiting, in heartbeat timeouts: each
#: look reads /proc (the proc's threads, the agent's), so a starved agent, whose procs are
#: often late, looks at each at most this often, not at every pass of its loop.
_LEAST_SLACK = 0.125


class Watchdog:
    """Keeps the heartbeat deadlines of the procs in a table and the last signs of life of
    their network owners; says who is overdue. It kills nothing itself: the agent does."""

    def __init__(
        self, procs: ProcTable, owner_timeout_s: float, log: Any, own: OwnWaits | None = None
    ) -> None:
        self._procs = procs
        self._own = own if own is not None else OwnWaits()
        self._excused: dict[str, float] = {}  # by proc: the agent's waiting already excused
        self.owner_timeout_s = owner_timeout_s
        self._owners_seen: dict[str, float] = {}
        self._woke = time.monotonic()  # when the serve loop's last wait ended
        self._wake_at = self._woke  # when its current wait is planned to end
        self._log = log  # the agent's structlog logger

    def start(self) -> None:
        """The serve loop starts now: its first stretch of work is measured from here."""
        self._woke = self._wake_at = time.monotonic()

    def heartbeat(self, proc: ProcRecord) -> None:
        """`proc` is alive: its next heartbeat is due a timeout from now."""
        proc.silent_since = now = time.monotonic()
        proc.heartbeat_due = now + proc.heartbeat_timeout_s
        proc.forgiven_s = 0.0
        if self._excused:
            self._excused.pop(proc.proc_id, None)
        if proc.pid is not None:  # the baseline for judging a later silence
            proc.cpu, proc.cpu_at = sample_cpu(proc.pid), now

    def forked(self, proc: ProcRecord) -> None:
        """`proc` was just forked: its first heartbeat is due a start-up grace from now (not
        from the request: a fork server busy with a large batch or a slow preload does not eat
        into it), and its CPU time is sampled, the baseline for judging a silence."""
        proc.expect_first_heartbeat()
        if proc.pid is not None:
            proc.cpu, proc.cpu_at = sample_cpu(proc.pid), time.monotonic()

    def owner_alive(self, owner: str) -> None:
        self._owners_seen[owner] = time.monotonic()

    def last_seen(self, owner: str) -> float | None:
        """When network owner `owner` last said it lives (None: not since it was declared gone)."""
        return self._owners_seen.get(owner)

    def gone_owners(self, now: float) -> list[str]:
        """The network owners silent for longer than the owner timeout, forgotten now."""
        gone = [o for o, seen in self._owners_seen.items() if now - seen > self.owner_timeout_s]
        for owner in gone:
            del self._owners_seen[owner]
        return gone

    def overdue(self, now: float) -> Iterator[tuple[ProcRecord, int]]:
        """The forked procs, with their pids, whose heartbeat is late (procs asked to stop are
        not judged: their kill deadline applies)."""
        for proc in self._procs:
            if proc.pid is not None and not proc.stop_requested and proc.heartbeat_due <= now:
                yield proc, proc.pid

    def hung(self, now: float) -> Iterator[tuple[ProcRecord, int, str]]:
        """The overdue procs judged hung, with their pids and why (the others get time)."""
        for proc, pid in self.overdue(now):
            why = self.judge_silence(proc, pid, now)
            if why is not None:
                yield proc, pid, why

    def judge_silence(self, proc: ProcRecord, pid: int, now: float) -> str | None:
        """Why `proc`, which missed its heartbeats, is hung; None (and more time) while it is
        busy: not stopped, and it used CPU time since the last sample or waits for a core."""
        sample = sample_cpu(pid, threads=True)
        if (sample is None and gone(pid)) or (sample is not None and sample.exited):
            # dead (a zombie, or reaped already): its exit report, with its signal, is on the
            # way from the fork server; a dead proc is never reported hung
            proc.heartbeat_due = now + proc.heartbeat_timeout_s
            return None
        why = why_hung(proc, sample, now)
        if why is not None and not (sample is not None and sample.stopped):
            slack_s = self._starved_s(proc, now)
            if slack_s >= _MIN_SLACK_S:  # its heartbeats may wait unread in this agent
                self._log.info("agent_starved", proc=proc.proc_id, seconds=round(slack_s, 3))
                proc.heartbeat_due = now + slack_s
                return None
        if why is None:
            self._log.info("proc_busy", proc=proc.proc_id, pid=pid)
            proc.cpu, proc.cpu_at = sample, now
            busy_until = proc.silent_since + proc.busy_timeout_s
            proc.heartbeat_due = min(now + proc.heartbeat_timeout_s, busy_until)
        return why

    def _starved_s(self, proc: ProcRecord, now: float) -> float:
        """How long this agent waited for a core while `proc` was silent, not excused yet:
        more time for it (at least `_LEAST_SLACK` heartbeat timeouts when that is over
        `_MIN_SLACK_S`), within `_MOST_SLACK` heartbeat timeouts and its busy limit."""
        waited, since = self._own.now(now), self._own.at(proc.silent_since)
        most_s = min(proc.busy_timeout_s, (1 + _MOST_SLACK) * proc.heartbeat_timeout_s)
        left_s = proc.silent_since + most_s - now
        if waited is None or since is None or left_s <= 0:
            return 0.0
        if len(self._excused) > 4 * len(self._procs) + 64:  # of procs gone meanwhile
            live = {p.proc_id for p in self._procs}
            self._excused = {k: v for k, v in self._excused.items() if k in live}
        excused = max(since, self._excused.get(proc.proc_id, since))
        self._excused[proc.proc_id] = waited
        slack_s = waited - excused
        if slack_s >= _MIN_SLACK_S:
            slack_s = max(slack_s, _LEAST_SLACK * proc.heartbeat_timeout_s)
        return min(slack_s, left_s)

    def waiting(self, timeout_s: float) -> float:
        """The serve loop is about to wait up to `timeout_s` (returned); a stretch of work
        before it that took longer than a pause is the agent's absence (stopped, or starved)."""
        now = time.monotonic()
        self._own.tick(now)
        self._wake_at = now + timeout_s
        worked_s = now - self._woke
        if worked_s > _PAUSE_S:
            self._forgive(worked_s, now)
        return timeout_s

    def woke(self) -> None:
        """The serve loop's wait ended: the time it overslept its planned wake-up (paused, or
        starved of CPU) is the agent's absence, not its procs' silence: their deadlines move
        by as much. Only the oversleep counts, never the loop's own work, so a deadline that
        set the wait can be reached but never pushed past now."""
        self._woke = now = time.monotonic()
        overslept_s = now - self._wake_at
        if overslept_s > 0:  # woken early or on time (a message): nothing moves; the hot path
            self._forgive(overslept_s, now)

    def _forgive(self, absent_s: float, now: float) -> None:
        """Move every deadline by `absent_s`; after a real pause, when messages sent meanwhile
        may still be on their way in, each restarts from now. A proc's silence is forgiven at
        most `busy_timeout_s` in all: an agent starved for good still judges a hung proc."""
        paused = absent_s > _PAUSE_S
        if paused:
            self._log.info("agent_was_paused", seconds=round(absent_s, 3))
        for proc in self._procs:
            due = proc.heartbeat_due + absent_s
            if paused:
                due = max(due, now + proc.heartbeat_timeout_s)
            moved = min(due - proc.heartbeat_due, proc.busy_timeout_s - proc.forgiven_s)
            if moved > 0:
                proc.heartbeat_due += moved
                proc.silent_since += moved
                proc.forgiven_s += moved
        for owner, seen in self._owners_seen.items():
            self._owners_seen[owner] = max(seen + absent_s, now) if paused else seen + absent_s

    def next_timeout(self) -> float:
        """Seconds until the next deadline: a kill, a heartbeat, an owner's (at most 1 s)."""
        deadlines = [
            p.kill_at if p.kill_at is not None else p.heartbeat_due
            for p in self._procs
            if p.pid is not None or p.kill_at is not None
        ]
        if self._owners_seen:
            deadlines.append(min(self._owners_seen.values()) + self.owner_timeout_s)
        return max(0.0, min(deadlines, default=time.monotonic() + 1.0) - time.monotonic())


def why_hung(proc: ProcRecord, sample: CpuSample | None, now: float) -> str | None:
    """Why `proc`, silent since `proc.silent_since` and sampled `sample` now, is hung; None
    while it is busy (it progresses, and its busy limit is not reached)."""
    silent_s = now - proc.silent_since
    if sample is not None and sample.stopped:
        return f"no heartbeat for {silent_s:.1f} s, and it is stopped (SIGSTOP or a debugger)"
    if not progressed(proc.cpu, sample, now - proc.cpu_at):
        return (
            f"no heartbeat for {silent_s:.1f} s, and it used no CPU time meanwhile "
            "(blocked or deadlocked)"
        )
    if silent_s >= proc.busy_timeout_s:
        return (
            f"no heartbeat for {silent_s:.1f} s while it kept using CPU time: busy but "
            f"unresponsive for longer than busy_timeout_s ({proc.busy_timeout_s:g} s)"
        )
    return None
