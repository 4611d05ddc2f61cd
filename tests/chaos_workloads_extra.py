"""Workloads that misbehave, for the chaos tests that check the harness is not a rubber stamp:
no restart policy, invariants that fail, a client that stalls, a workload without a target;
and two that let a test see inside the client (how often a failure is raised, how it ended)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from chaos_workloads import FOREVER, HEARTBEATS, Counter, counters

from chaos import Job
from supervision import (
    ActorError,
    SupervisionError,
    SupervisionEvent,
    add_event_listener,
    set_unhandled_failure_hook,
)

#: How long `stalls` blocks without calling ``job.running()`` (tests use a lower hang limit).
STALL_S = 2.5
#: What the string invariant of `broken_invariants` returns, and what the raising one raises.
LEDGER_DETAIL = "the ledger is off by 3"
AUDIT_ERROR = "audit log missing"


def no_restart_crash(job: Job) -> None:
    """Ranks without a restart policy, and nothing that handles a failure: the first killed
    rank is raised in the client's main thread (fail-fast) and ends the client.

    It only calls rank 0 (tests kill another rank), so the failure reaches the main thread by
    fail-fast itself, not through a call to the dead rank (see `fail_fast_raises`)."""
    procs = job.hosts.spawn_procs(per_host={"gpus": 2}, name="fragile", **HEARTBEATS)
    actors = job.target(procs.spawn("counters", Counter), heartbeat_timeout_s=1.0)
    first = actors.flatten("rank").slice(rank=0)
    while job.running():
        first.incr.call().get(timeout=5.0)
        job.sleep(0.005)


#: How long the slow listener of `fail_fast_raises` holds up the supervisor's decision.
LISTENER_DELAY_S = 0.5


def fail_fast_raises(job: Job) -> None:
    """Counts how often one unhandled failure is raised in the main thread (it must be once).

    Ranks without a restart policy, and no hook. A slow event listener holds the supervisor
    between marking the killed proc gone and deciding about the failure (fail-fast); meanwhile
    the main thread calls the dead rank, and that call fails at once. Then the main thread only
    sleeps, catching whatever is raised, until the run ends."""
    procs = job.hosts.spawn_procs(per_host={"gpus": 2}, name="once", **HEARTBEATS)
    actors = job.target(procs.spawn("counters", Counter), heartbeat_timeout_s=1.0)
    dead = threading.Event()

    def slow_listener(event: SupervisionEvent) -> None:
        if event.kind == "signal":
            dead.set()
            time.sleep(LISTENER_DELAY_S)

    add_event_listener(slow_listener)  # after the job's own: the harness hears of it first
    raised: list[str] = []
    job.invariant(
        "one failure is raised once in the main thread",
        lambda: len(raised) == 1 or f"raised {len(raised)} times: {raised}",
    )
    while True:
        try:
            if not job.running():
                break
            if dead.is_set() and not raised:
                actors.incr.call().get(timeout=5.0)  # fails at once: a rank is gone
            job.sleep(0.005)
        except SupervisionError as exc:
            raised.append(f"{type(exc).__name__}: {exc}")


def no_restart_tolerant(job: Job) -> None:
    """Ranks without a restart policy; the client handles every failure (so it survives), but
    nothing brings a failed rank back."""
    set_unhandled_failure_hook(lambda event: True)
    procs = job.hosts.spawn_procs(per_host={"gpus": 2}, name="unrestarted", **HEARTBEATS)
    actors = job.target(procs.spawn("counters", Counter), heartbeat_timeout_s=1.0)
    while job.running():
        try:
            actors.incr.call().get(timeout=1.0)
        except (SupervisionError, ActorError, TimeoutError):
            pass
        job.sleep(0.01)


def _audit() -> bool:
    raise ValueError(AUDIT_ERROR)


def broken_invariants(job: Job) -> None:
    """`counters`, with invariants that do not hold: one returns a string (the reason), one
    raises, one returns False."""
    job.invariant("the ledger balances", lambda: LEDGER_DETAIL)
    job.invariant("the audit passes", _audit)
    job.invariant("the flag is set", lambda: False)
    counters(job)


def stalls(job: Job) -> None:
    """Like `counters`, but at its first step it blocks for `STALL_S` seconds without calling
    ``job.running()``: a client that hangs for a while. At the first step, since the run
    cannot end before it: the harness starts its faults once that step announced the workload."""
    procs = job.hosts.spawn_procs(
        per_host={"gpus": 2}, name="stalling", restart=FOREVER, **HEARTBEATS
    )
    actors = job.target(procs.spawn("counters", Counter), heartbeat_timeout_s=1.0)
    stalled = False
    while job.running():
        if not stalled:
            stalled = True
            time.sleep(STALL_S)  # deliberately not job.sleep: no progress is reported
        try:
            actors.incr.call().get(timeout=2.0)
        except (SupervisionError, ActorError, TimeoutError):
            pass
        job.sleep(0.005)


def no_target(job: Job) -> None:
    """Spawns nothing chaos may aim at, and runs anyway."""
    while job.running():
        job.sleep(0.01)


def counters_noting_the_end(job: Job) -> None:
    """`counters`, which, when the run ends normally (the harness says so), writes the file
    named by $MESHVISOR_CHAOS_TEST_END_FILE: a test can tell that from being killed."""
    counters(job)
    end_file = os.environ.get("MESHVISOR_CHAOS_TEST_END_FILE")
    if end_file:
        Path(end_file).write_text(f"ended after {job.steps} steps\n")
