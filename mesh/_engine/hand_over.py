"""`HolderCheck`: whether the thread holding a proc's inbox is stuck, for the receiver's watch.

A task that runs long on the receiving thread is either progressing (a drain of many short
calls, or a thread preempted by a busy machine) or not (a call that blocks, or one that
computes for long). Only the second should hand the inbox to another thread: handing it over
during a drain leaves two threads taking turns on the GIL, one receiving and one running.
The watch cannot tell from the wall clock (on a loaded machine a progressing thread often
waits more than `HAND_OVER_S` for a core), so it looks at the thread itself, twice or more,
longer than the GIL's switch interval apart: calls it ended (progress; other threads' calls
ending tell nothing of it), its CPU time (a blocked
thread uses none; one waiting for the GIL wakes at each switch interval, using a little) and
its scheduler state (a preempted one is runnable).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class HolderCheck:
    """Looks at one thread while it runs one task (make a new one for the next task)."""

    def __init__(
        self, ident: int, native_id: int, steps: Callable[[], int], busy_s: float, idle_s: float
    ) -> None:
        # made while the thread runs its task: a clock of a thread gone fails (EINVAL), where
        # asking a gone thread's clock would be undefined
        self._clock = time.pthread_getcpuclockid(ident)
        self._stat = f"/proc/self/task/{native_id}/stat"
        self._steps = steps  # how many calls this thread has ended (its own: not other threads')
        self._busy_s = busy_s  # CPU time a thread may use with no call ending
        self._idle_s = idle_s  # wall time a thread found asleep may go with no call ending
        self._last: tuple[float, int] | None = None  # (its CPU time, steps) at the last look
        self._cpu_at_step = 0.0  # its CPU time when a call last ended (or at the first look)
        self._wall_at_step = 0.0  # the time then

    def stuck(self) -> bool | None:
        """True: hand the inbox over (blocked; busy with no call ending for `busy_s` of CPU;
        or asleep now, with naps, and no call ending for `idle_s`); False: keep it; None: the
        first look, nothing to compare with yet."""
        runnable = self._runnable()  # before the CPU time: see `_blocked`
        try:
            cpu = time.clock_gettime(self._clock)
        except OSError:  # the thread has ended
            return True
        steps, now = self._steps(), time.monotonic()
        last, self._last = self._last, (cpu, steps)
        if last is None or steps != last[1]:
            self._cpu_at_step, self._wall_at_step = cpu, now
            return None if last is None else False
        if cpu == last[0]:  # no CPU since the last look: asleep, or waiting for a core
            return not runnable
        if not runnable and now - self._wall_at_step >= self._idle_s:
            return True  # a call that naps (polling, say) without ending
        return cpu - self._cpu_at_step >= self._busy_s

    def _runnable(self) -> bool:
        """Whether the thread is running or waiting for a core (not asleep). Read before its
        CPU time: a thread asleep now that used no CPU since the last look slept all along."""
        try:
            with open(self._stat, "rb") as stat:
                return stat.read().rsplit(b")", 1)[1].split(None, 1)[0] == b"R"
        except (OSError, IndexError):
            return False
