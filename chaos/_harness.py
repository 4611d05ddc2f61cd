"""`run_chaos`: run a workload on a local allocation (or a SLURM job), inject a schedule of
faults, measure how the job notices and heals each one, check the invariants, and return the
report.

The harness is its own process, apart from the workload's client, so that it can kill the
client too. It starts the allocation (one daemon agent per host), starts the client, learns
the targets from it, plans the schedule against them, injects each fault when due and follows
it (`_follow`): the supervision event the owner saw (reported by the client), then the moment
the target answered again. After the last fault it heals everything, lets the workload finish
and run its invariants, and checks that nothing was left behind (`_verdicts`).
"""

from __future__ import annotations

import datetime
import shlex
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ._allocation import LocalAllocation
from ._clients import Clients
from ._clock import RunClock
from ._errors import ChaosSetupError
from ._faults import FAULT_SPECS
from ._follow import FaultRun, Observations, expected_events
from ._model import FaultRecord, PlannedFault
from ._options import ChaosOptions
from ._report import RunReport
from ._schedule import Schedule
from ._slurm_allocation import SlurmAllocation
from ._targets import TargetSet
from ._verdicts import builtin_invariants, check_leftovers


class Harness:
    """One chaos run; see `run_chaos`."""

    def __init__(self, workload: str, schedule: Schedule, options: ChaosOptions) -> None:
        self.workload = workload
        self.schedule = schedule
        self.options = options
        self._clock = RunClock()
        self._observations = Observations(self._clock, self._update)
        self._heartbeat_timeouts: dict[str, float] = {}

    def run(self) -> RunReport:
        """Run the workload under the schedule and return the report."""
        started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        wall = time.monotonic()
        check_fits_allocation(self.schedule, self.options)
        with self._allocation() as alloc:
            clients = Clients(self.workload, self.options, alloc, self._observations.on_event)
            targets = self._run_faults(clients)
            leftovers = check_leftovers(alloc, clients.orphans_of_killed, self.options)
        faults = self._observations.records()
        events = list(self._observations.events)
        return RunReport(
            seed=self.schedule.seed,
            replay=replay_command(self.workload, self.schedule, self.options),
            workload=self.workload,
            started_at=started_at,
            wall_s=round(time.monotonic() - wall, 3),
            schedule=self.schedule.to_dict(),
            targets=targets.to_dict(),
            faults=faults,
            events=events,
            invariants=[
                *builtin_invariants(faults, events, clients),
                *leftovers,
                *clients.invariants,
            ],
            workload_stats={
                "steps": clients.steps,
                "max_step_gap_s": round(clients.max_gap, 3),
                "clients": clients.started,
                **clients.records,
            },
        )

    def _allocation(self) -> LocalAllocation | SlurmAllocation:
        """A fresh allocation: local agents, or a SLURM job when the options say so."""
        options = self.options
        if options.slurm is None:
            return LocalAllocation(
                options.hosts,
                owner_timeout_s=options.owner_timeout_s,
                preload=options.preload,
                verbose=options.verbose,
            )
        return SlurmAllocation(
            options.hosts,
            cluster=None if options.slurm == "env" else options.slurm,
            partition=options.slurm_partition,
            slurm_args=options.slurm_args,
            start_timeout_s=options.start_timeout_s,
            progress=self._update,
        )

    def _run_faults(self, clients: Clients) -> TargetSet:
        """Start the client, inject the schedule's faults, heal and let the workload finish."""
        client = clients.start(0)
        try:
            ready = clients.wait_ready(client)
            targets = TargetSet(
                tuple(ready["meshes"].items()),
                ready["hosts"],
                client=True,
                job=clients.alloc.on_slurm,
            )
            self._heartbeat_timeouts = dict(ready["heartbeat_timeouts"])
            try:
                plan = self.schedule.plan(targets)
            except ValueError as exc:
                raise ChaosSetupError(f"the schedule does not fit the workload: {exc}") from exc
            self._clock.restart()
            clients.start_progress_clock()
            self._update(f"running {len(plan)} faults over {self._duration():g} s")
            self._inject_all(plan, clients)
            clients.final_heal_and_finish()
        except BaseException:
            clients.tell_to_finish()  # so that it ends (and cleans up) on its own
            raise
        finally:
            clients.stop()
        return targets

    def _duration(self) -> float:
        """How long faults are injected: the schedule's duration, or its last fault's time."""
        duration = getattr(self.schedule, "duration_s", None)
        if duration is not None:
            return float(duration)
        return max((p.at_s for p in getattr(self.schedule, "faults", ())), default=0.0)

    def _inject_all(self, plan: list[PlannedFault], clients: Clients) -> None:
        limit = int(getattr(self.schedule, "max_concurrent", 1) or 1)
        for index, planned in enumerate(plan):
            self._clock.sleep_until(planned.at_s)
            while self._observations.active() >= limit:  # the limit holds at run time
                time.sleep(0.01)
            expected = expected_events(planned, self._heartbeat_timeouts, self.options)
            run = FaultRun(
                FaultRecord(index, planned, expected),
                clients,
                self.options,
                self._clock,
                self.schedule.seed,
            )
            self._observations.add(run)
            threading.Thread(target=run.run, args=(self._update,), daemon=True).start()
        self._clock.sleep_until(max(self._duration(), plan[-1].at_s if plan else 0.0))
        deadline = time.monotonic() + self.options.heal_timeout_s + self.options.detect_timeout_s
        for run in self._observations.runs:
            run.done.wait(max(0.0, deadline - time.monotonic()))

    def _update(self, line: str) -> None:
        if self.options.on_update is not None:
            self.options.on_update(f"[{self._clock.now_s():8.3f}s] {line}")


def replay_command(workload: str, schedule: Schedule, options: ChaosOptions) -> str:
    """The ``meshvisor chaos run`` command line that replays a run of `workload` under
    `schedule` with `options` (the report's "replay with" line)."""
    args = ["meshvisor", "chaos", "run", workload, *schedule.replay_args()]
    args += ["--hosts", str(options.hosts)]
    if options.slurm is not None:
        args += ["--slurm", "env" if options.slurm == "env" else "local"]
    if options.slurm_partition is not None:
        args += ["--partition", options.slurm_partition]
    return shlex.join(args)


def check_fits_allocation(schedule: Schedule, options: ChaosOptions) -> None:
    """ChaosSetupError if `schedule` has faults that only a run on SLURM can inject (node
    faults, preemption) while `options` run it on this machine's agents."""
    needing = [kind for kind in schedule.kinds() if FAULT_SPECS[kind].needs_slurm]
    if needing and options.slurm is None:
        raise ChaosSetupError(
            f"the fault kinds {', '.join(needing)} act on SLURM's nodes and jobs, but this run "
            "is on agents of this machine: run it on SLURM (ChaosOptions(slurm=...), or "
            "--slurm local / --slurm env), or take them out of the schedule"
        )


def run_chaos(
    workload: str | Callable[..., Any],
    schedule: Schedule,
    options: ChaosOptions | None = None,
) -> RunReport:
    """Run `workload` (``file.py:function``, ``module:function`` or an importable function)
    under `schedule` on a fresh allocation (local agents, or a SLURM job: `ChaosOptions.slurm`),
    and return the report."""
    return Harness(workload_reference(workload), schedule, options or ChaosOptions()).run()


def workload_reference(workload: str | Callable[..., Any]) -> str:
    """The ``file.py:function`` a client process can load `workload` from."""
    if isinstance(workload, str):
        return workload
    module = sys.modules.get(workload.__module__)
    path = getattr(module, "__file__", None)
    if path is None or "<locals>" in workload.__qualname__:
        raise ChaosSetupError(
            f"the workload {workload.__qualname__} must be a module-level function of a file "
            "(the client process loads it from there)"
        )
    return f"{path}:{workload.__qualname__}"
