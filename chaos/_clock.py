"""The clock of one chaos run: times in the report are seconds after the run started."""

from __future__ import annotations

import time


class RunClock:
    """Seconds since the start of the run (restarted once the workload is ready)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def restart(self) -> None:
        """Make now the start of the run."""
        self.t0 = time.monotonic()

    def now_s(self) -> float:
        """Seconds since the start, rounded to 0.1 ms."""
        return self.at_s(time.monotonic())

    def at_s(self, moment: float) -> float:
        """The `time.monotonic()` value `moment` as seconds since the start."""
        return round(moment - self.t0, 4)

    def remaining_s(self, at_s: float) -> float:
        """Seconds from now until `at_s` seconds after the start (0 when past)."""
        return max(0.0, self.t0 + at_s - time.monotonic())

    def sleep_until(self, at_s: float) -> None:
        """Sleep until `at_s` seconds after the start."""
        time.sleep(self.remaining_s(at_s))
