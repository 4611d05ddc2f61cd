"""Is a silent proc hung, or busy? What the host agent asks the kernel before killing one.

A proc's heartbeats come from a Python thread, so they stop whenever the process cannot run
Python code: when it is stopped (SIGSTOP, a debugger), blocked holding the GIL, deadlocked, but
also when it is merely slow: a long C call that holds the GIL, or a machine so oversubscribed
that the thread is not scheduled in time. The kernel tells these apart: a stopped process is in
state T (t when traced), one that makes progress uses CPU time, and one starved of CPU has a
runnable thread waiting for a core. Linux only (``/proc``); elsewhere there is no sample, and a
silent proc is hung as soon as its heartbeats are late.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: CPU time a proc must use to count as progressing: at least two clock ticks, and this share
#: of the wall time since the last sample (a proc sharing a core with 50 others still gets 2 %).
_MIN_PROGRESS_S = 2 * _TICK_S
_MIN_PROGRESS_SHARE = 0.01


@dataclass(frozen=True, slots=True)
class CpuSample:
    """A process's scheduler state, the CPU time all its threads have used so far, and
    whether one of its threads is running or waiting for a core (when that was asked); also
    its resident memory (for the live view)."""

    state: str
    cpu_s: float
    runnable: bool = False
    rss_bytes: int | None = None

    @property
    def stopped(self) -> bool:
        """Stopped by a signal (T) or by a tracer (t): it cannot progress until continued."""
        return self.state in ("T", "t")

    @property
    def exited(self) -> bool:
        """A zombie (Z) or dying (X): it exited and its parent has yet to reap it."""
        return self.state in ("Z", "X")


def gone(pid: int) -> bool:
    """Whether `pid` has no entry in ``/proc`` on a system that has one: it exited and was
    reaped (by the fork server, whose report of it is on the way)."""
    return os.path.isdir("/proc/self") and not os.path.exists(f"/proc/{pid}")


def sample_cpu(pid: int, threads: bool = False) -> CpuSample | None:
    """`pid`'s state and CPU time from ``/proc/PID/stat`` (with `threads`, also whether a
    thread is runnable); None where there is no such file (not Linux, or the process is gone)."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    try:  # fields after the command name: state is the 3rd of the line, utime/stime 14 and 15
        state, cpu_s = fields[0].decode(), (int(fields[11]) + int(fields[12])) * _TICK_S
        rss_bytes = int(fields[21]) * _PAGE_BYTES  # the 24th
    except (IndexError, ValueError):
        return None
    return CpuSample(state, cpu_s, threads and _thread_runnable(pid), rss_bytes)


def waited_s() -> float | None:
    """How long the threads of this process have waited, runnable, for a core
    (``/proc/self/task/*/schedstat``, in all); None where that cannot be read."""
    where = "/proc/self/task"
    try:
        tids = os.listdir(where)
    except OSError:
        return None
    total_ns = 0
    for tid in tids:
        try:
            with open(f"{where}/{tid}/schedstat", "rb") as stat:
                total_ns += int(stat.read().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that just ended
            continue
    return total_ns / 1e9


def _thread_runnable(pid: int) -> bool:
    """Whether a thread of `pid` is running or in a run queue (state R)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any(_stat_fields(f"/proc/{pid}/task/{tid}/stat")[:1] == [b"R"] for tid in tids)


def _stat_fields(path: str) -> list[bytes]:
    """The fields of a ``/proc`` stat file after the command name; empty if unreadable."""
    try:
        with open(path, "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def progressed(before: CpuSample | None, after: CpuSample | None, elapsed_s: float) -> bool:
    """Whether a process sampled `before` and, `elapsed_s` later, `after` is not stopped and
    used CPU time meanwhile, or waits for a core. Without both samples: no."""
    if before is None or after is None or after.stopped:
        return False
    if after.runnable:
        return True
    used = after.cpu_s - before.cpu_s
    return used >= max(_MIN_PROGRESS_S, _MIN_PROGRESS_SHARE * elapsed_s)


class OwnWaits:
    """How long this process (the agent) waited for a core, sampled every `every_s`: a proc's
    heartbeats may wait unread in the agent's starved zmq I/O thread, and that silence is the
    agent's, not the proc's (the serve loop's own lateness is counted apart, `Watchdog`)."""

    def __init__(
        self, read: Callable[[], float | None] = waited_s, every_s: float = 0.25, keep: int = 240
    ) -> None:
        self._read = read
        self._every_s = every_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=keep)  # (when, waited so far)
        self._next_at = 0.0

    def tick(self, now: float) -> None:
        """Sample, if the last sample is `every_s` old (the serve loop calls this each turn)."""
        if now >= self._next_at:
            self._next_at = now + self._every_s
            self.now(now)

    def now(self, now: float) -> float | None:
        """How long this process has waited for a core so far (sampled)."""
        waited = self._read()
        if waited is not None:
            self._samples.append((now, waited))
        return waited

    def at(self, when: float) -> float | None:
        """How long it had waited at the last sample at or before `when` (the oldest kept
        if none is that old; None without samples)."""
        found = self._samples[0][1] if self._samples else None
        for at, waited in self._samples:
            if at > when:
                break
            found = waited
        return found
