"""What a fault kind's spec works with: the detectors' timeouts that decide which events are
expected, the ranges a random schedule draws parameters from, and the `FaultSite` through which
the harness lets a spec inject and heal its fault."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Detectors:
    """The timeouts of the detectors that notice faults on a target."""

    heartbeat_timeout_s: float  # of the target mesh's procs (a pause is seen as a hang)
    agent_timeout_s: float  # of the client for agents (a partition is seen as unreachable)


class FaultRanges(Protocol):
    """The ranges a random schedule draws fault parameters from (`RandomSchedule` has them)."""

    @property
    def kill_signals(self) -> tuple[str, ...]: ...
    @property
    def exit_codes(self) -> tuple[int, ...]: ...
    @property
    def pause_s(self) -> tuple[float, float]: ...
    @property
    def drop_probability(self) -> float: ...
    @property
    def delay_ms(self) -> tuple[float, float]: ...
    @property
    def window_s(self) -> tuple[float, float]: ...
    @property
    def raise_endpoint(self) -> str | None: ...


class FaultSite(Protocol):
    """What injecting and healing one fault may do; the harness gives one per fault."""

    #: The target's processes when the fault was injected.
    pids: set[int]
    #: Set when the owner saw an event that counts as noticing the fault.
    detected: threading.Event

    def request(self, op: str, **args: Any) -> Any:
        """Ask the workload's client to carry out `op` (see `Job`'s operations)."""
        ...

    def link_seed(self) -> int:
        """The seed for this fault's broken links, derived from the schedule's."""
        ...

    def remaining_s(self, after_s: float) -> float:
        """Seconds from now until `after_s` seconds after the injection (0 when past)."""
        ...

    def wait_until_every_process_told(self, timeout_s: float) -> int:
        """Wait until an expected event came about each of the target's processes (at most
        `timeout_s`); how many were told."""
        ...

    def kill_agent(self, host: int) -> None: ...
    def restart_agent(self, host: int) -> None: ...
    def kill_client(self) -> None: ...
    def restart_client(self) -> None: ...
    def kill_node(self, host: int) -> None: ...
    def restore_node(self, host: int) -> None: ...
    def preempt(self) -> None: ...
