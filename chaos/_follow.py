"""One fault of a chaos run, from injection to verdict: inject it as its kind's spec says, wait
for the owner to notice it, heal it, and wait until the target answers again. `Observations`
attributes each supervision event the client reports to the fault that caused it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ._allocation import Allocation
from ._channel import Message
from ._clients import Clients
from ._clock import RunClock
from ._fault_sites import Detectors
from ._faults import DEFAULT_HEARTBEAT_TIMEOUT_S, NO_EVENT
from ._model import FaultRecord, ObservedEvent, PlannedFault
from ._options import ChaosOptions
from ._targets import Target

#: How long after a fault ends an event that may or may not come is still waited for.
OPTIONAL_EVENT_GRACE_S = 1.0
#: Event kinds after which the failed process is gone (a healthy answer must come from another).
_DEADLY = frozenset({"signal", "exit", "hung", "unreachable", "oom"})
#: How long an operation asked of the client while injecting may take.
_REQUEST_TIMEOUT_S = 10.0


def expected_events(
    planned: PlannedFault, heartbeat_timeouts: dict[str, float], options: ChaosOptions
) -> tuple[str, ...]:
    """The event kinds that count as the owner noticing `planned` (see `FaultSpec.expected`)."""
    heartbeat = heartbeat_timeouts.get(planned.target.mesh or "", DEFAULT_HEARTBEAT_TIMEOUT_S)
    detectors = Detectors(heartbeat, options.agent_timeout_s)
    return planned.fault.spec.expected(planned.fault, detectors)


class FaultRun:
    """One planned fault being injected and followed; also the `FaultSite` its spec acts on."""

    def __init__(
        self,
        record: FaultRecord,
        clients: Clients,
        options: ChaosOptions,
        clock: RunClock,
        seed: int | None,
    ) -> None:
        self.record = record
        self.pids: set[int] = set()
        self.detected = threading.Event()
        self.done = threading.Event()
        self._told: set[int | None] = set()
        self._told_changed = threading.Condition()
        self._clients = clients
        self._alloc: Allocation = clients.alloc
        self._options = options
        self._clock = clock
        self._seed = seed or 0

    # -- the FaultSite the spec acts on ----------------------------------------------------------

    def request(self, op: str, **args: Any) -> Any:
        """Ask the workload's client to carry out `op`."""
        return self._clients.request(op, _REQUEST_TIMEOUT_S, **args)

    def link_seed(self) -> int:
        """The seed for this fault's broken links, derived from the schedule's."""
        return self._seed * 1_000_003 + self.record.index

    def remaining_s(self, after_s: float) -> float:
        """Seconds from now until `after_s` seconds after the injection (0 when past)."""
        return self._clock.remaining_s((self.record.injected_at_s or 0.0) + after_s)

    def kill_agent(self, host: int) -> None:
        """Kill the agent of `host`."""
        self._alloc.kill(host)

    def restart_agent(self, host: int) -> None:
        """Start the agent of `host` again, the restart delay after it was killed."""
        time.sleep(self.remaining_s(self._options.restart_delay_s))
        self._alloc.start(host)

    def kill_client(self) -> None:
        """Kill the workload's client."""
        self._clients.kill()

    def restart_client(self) -> None:
        """Start the workload's client again, the restart delay after it was killed."""
        time.sleep(self.remaining_s(self._options.restart_delay_s))
        self._clients.restart()

    def wait_until_every_process_told(self, timeout_s: float) -> int:
        """Wait until an expected event came about each of the target's processes (at most
        `timeout_s`); how many were told."""
        with self._told_changed:
            self._told_changed.wait_for(lambda: self.pids <= self._told, timeout_s)
            return len(self.pids & self._told)

    def note_told(self, pid: int | None) -> None:
        """An expected event came about process `pid`."""
        with self._told_changed:
            self._told.add(pid)
            self._told_changed.notify_all()

    def follows_host(self, host: int | None) -> bool:
        """Whether this fault, aimed at host `host` or the whole job, is still followed."""
        target = self.record.planned.target
        aimed = target.level == "job" or (target.level == "host" and target.host == host)
        return aimed and host is not None and not self.done.is_set()

    def kill_node(self, host: int) -> None:
        """Lose the SLURM node of `host`."""
        self._alloc.kill_node(host)

    def restore_node(self, host: int) -> None:
        """Bring the node of `host` and its agent back, the restart delay after it was lost."""
        time.sleep(self.remaining_s(self._options.restart_delay_s))
        self._alloc.restore_node(host)

    def preempt(self) -> None:
        """Send SLURM's preemption notice to the job."""
        self._alloc.preempt()

    # -- the run of the fault -----------------------------------------------------------------

    def run(self, update: Callable[[str], None]) -> None:
        """Inject the fault, follow it to its verdict, and say what happened through `update`."""
        record = self.record
        try:
            self._inject()
        except Exception as exc:
            record.verdict, record.note = "not_injected", f"{type(exc).__name__}: {exc}"
            update(f"#{record.index} {record.planned.fault.describe()}: not injected ({exc})")
            self.done.set()
            return
        update(f"#{record.index} {record.planned.fault.describe()} on {record.planned.target}")
        try:
            self._follow()
        except Exception as exc:
            record.verdict = "not_healed"
            record.note = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()
        update(
            f"#{record.index} {record.verdict}: detected {_ms(record.detect_s)}, "
            f"healthy {_ms(record.recover_s)}"
        )

    def _inject(self) -> None:
        fault, target = self.record.planned.fault, self.record.planned.target
        self._clients.require()  # no fault without a workload client
        self.pids = self._processes_of_target()
        self.record.injected_at_s = self._clock.now_s()
        fault.spec.inject(fault, target, self)

    def _processes_of_target(self) -> set[int]:
        """The processes the target runs in now (none for the client)."""
        target = self.record.planned.target
        if target.level == "rank":
            resolved = self._clients.request(
                "resolve", _REQUEST_TIMEOUT_S, mesh=target.mesh, rank=target.rank, timeout=5.0
            )
            return {resolved["pid"]}
        if target.level in ("host", "job"):
            return {pid for _, _, pid in self._ranks_of(target) if pid is not None}
        return set()

    def _ranks_of(self, target: Target) -> list[tuple[str, int, int | None]]:
        """Every target rank on the host `target` is (on every host for the job): (mesh,
        rank, pid)."""
        hosts = range(self._alloc.hosts) if target.level == "job" else [target.host]
        return [
            tuple(r)
            for host in hosts
            for r in self._clients.request("ranks_on", _REQUEST_TIMEOUT_S, host=host)
        ]

    def _follow(self) -> None:
        record = self.record
        fault, target = record.planned.fault, record.planned.target
        fault.spec.heal(fault, target, self)
        expected = [k for k in record.expected if k != NO_EVENT]
        if expected and NO_EVENT in record.expected:
            # An optional event can only come while the fault lasts, or just after: probe
            # at once, and again if the event comes after all.
            record.healthy_at_s = self._wait_healthy()
            self.detected.wait(self.remaining_s(fault.duration_s + OPTIONAL_EVENT_GRACE_S))
            if self.detected.is_set():
                record.healthy_at_s = self._wait_healthy()
        else:
            if expected:
                self.detected.wait(
                    self.remaining_s(fault.duration_s + self._options.detect_timeout_s)
                )
            record.healthy_at_s = self._wait_healthy()
        self._judge_detection()
        if record.verdict == "not_injected":
            record.verdict = "ok"

    def _judge_detection(self) -> None:
        record = self.record
        expected = [k for k in record.expected if k != NO_EVENT]
        seen = record.observed
        if not expected:
            if seen and NO_EVENT not in record.expected:
                record.verdict = "wrong_kind"
                record.note = f"expected no event, saw {', '.join(seen)}"
            return
        if record.detected_at_s is not None:
            return
        if NO_EVENT in record.expected and not seen:
            return
        record.verdict = "wrong_kind" if seen else "missed"
        record.note = (
            f"expected {' or '.join(expected)}, saw {', '.join(seen)}"
            if seen
            else f"expected {' or '.join(expected)}, saw nothing in "
            f"{self._options.detect_timeout_s:g} s"
        )

    def _wait_healthy(self) -> float:
        """When the target answered again (seconds after the start of the run)."""
        record = self.record
        target = record.planned.target
        timeout = self._options.heal_timeout_s
        if target.level == "client":
            answer = self._clients.request("heal", timeout + 5, timeout=timeout)
        else:
            if target.level == "rank":
                ranks = [[target.mesh, target.rank]]
            else:
                ranks = [[mesh, rank] for mesh, rank, _ in self._ranks_of(target)]
            gone = self._gone_pids()
            answer = self._clients.request(
                "wait_healthy", timeout + 5, ranks=ranks, exclude_pids=sorted(gone), timeout=timeout
            )
        healthy = self._clock.at_s(float(answer["at"]))
        if record.verdict not in ("missed", "wrong_kind"):
            record.verdict = "ok"
        return healthy

    def _gone_pids(self) -> set[int]:
        """The processes that cannot be the ones answering after the fault."""
        record = self.record
        if set(record.observed) & _DEADLY or record.planned.fault.spec.kills_process:
            return self.pids
        return set()


class Observations:
    """The faults being followed, and every supervision event the owner saw, each attributed
    to the fault that caused it."""

    def __init__(self, clock: RunClock, update: Callable[[str], None]) -> None:
        self._clock = clock
        self._update = update
        self._lock = threading.Lock()
        self.runs: list[FaultRun] = []
        self.events: list[ObservedEvent] = []

    def add(self, run: FaultRun) -> None:
        """Follow `run` from now on."""
        with self._lock:
            self.runs.append(run)

    def active(self) -> int:
        """How many faults are still being followed."""
        with self._lock:
            return sum(not run.done.is_set() for run in self.runs)

    def records(self) -> list[FaultRecord]:
        """The record of every fault so far, in plan order."""
        return [run.record for run in self.runs]

    def on_event(self, message: Message) -> None:
        """Note an event the client reported, and whether it means its fault was detected."""
        at_s = self._clock.at_s(message["at"])
        run = self._attribute(message)
        event = ObservedEvent(
            at_s,
            message["kind"],
            message.get("mesh"),
            message.get("rank"),
            message.get("host"),
            message.get("pid"),
            message.get("message", ""),
            run.record.index if run is not None else None,
            message.get("evidence", ""),
        )
        with self._lock:
            self.events.append(event)
        if run is None:
            self._update(f"unexpected event: {event.message}")
            return
        record = run.record
        record.observed.append(event.kind)
        if event.kind in record.expected:
            run.note_told(event.pid)
            if record.detected_at_s is None:
                record.detected_at_s = at_s
                run.detected.set()

    def _attribute(self, message: Message) -> FaultRun | None:
        """The latest fault injected before this event on the process it concerns; else the
        fault being followed on its host: for an event on a rank with no process (its host is
        lost), one aimed at that host or the job; for a process the fault did not know of (its
        rank was still starting when a host fault was injected), one aimed at that host."""
        pid = message.get("pid")
        at = message["at"] - self._clock.t0
        with self._lock:
            injected = [
                run
                for run in reversed(self.runs)
                if run.record.injected_at_s is not None and run.record.injected_at_s <= at + 0.001
            ]
        host = message.get("host")
        if pid is None:
            return next((run for run in injected if run.follows_host(host)), None)
        known = next((run for run in injected if pid in run.pids), None)
        if known is not None:
            return known
        at_host = (run for run in injected if run.record.planned.target.level == "host")
        return next((run for run in at_host if run.follows_host(host)), None)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
