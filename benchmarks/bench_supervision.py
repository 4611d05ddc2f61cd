"""Failure detection latency: from a fault to the caller's SupervisionError and to the owner.

For each fault kind, a fresh proc runs an actor with a call in flight (a 60 s sleep); the fault
is injected and two times are recorded: when the in-flight call raised SupervisionError (the
caller) and when the mesh's on_failure handler ran (the owner). Prints a table of p50/p99 in
milliseconds; --json for machines. Targets (issue #3): p99 <= 50 ms for deaths, <= 3 s for
hangs with the default heartbeat settings.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

from mesh import Actor, endpoint, this_host
from supervision import SupervisionError


class Victim(Actor):
    def __init__(self, fail_at: float | None = None) -> None:
        if fail_at is not None:
            time.sleep(max(0.0, fail_at - time.time()))
            raise RuntimeError("constructor failure injected by the benchmark")

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return "woke"

    @endpoint
    def exit_at(self, when: float, code: int) -> None:
        """Exit the process with `code` at wall-clock time `when`, while other calls run."""

        def later() -> None:
            time.sleep(max(0.0, when - time.time()))
            os._exit(code)

        threading.Thread(target=later, daemon=True).start()


def _local_agent_pid() -> int:
    out = subprocess.check_output(["pgrep", "-f", f"mesh._agent.*--owner-pid {os.getpid()}"])
    return int(out.split()[0])


def _trial(fault: str) -> tuple[float, float]:
    """One fault; returns (ms to the caller's error, ms to the owner's handler)."""
    owner_seen = threading.Event()
    seen_at: list[float] = []
    procs = this_host().spawn_procs(per_host={"rank": 1}, name=f"bench-{fault}")
    procs.on_failure(lambda event: seen_at.append(time.time()) or owner_seen.set() or True)
    victim_args: tuple[float, ...] = ()
    fault_at = time.time() + 0.05
    if fault == "init":
        victim_args = (fault_at,)
    victim = procs.spawn("victim", Victim, *victim_args)
    if fault != "init":
        pid = victim.pid.call_one().get(timeout=30)
    if fault == "exit":
        victim.exit_at.call_one(fault_at, 3).get(timeout=30)
    in_flight = victim.sleep.call_one(60.0)
    if fault not in ("init", "exit"):
        time.sleep(max(0.0, fault_at - time.time()))
        fault_at = time.time()
        target = _local_agent_pid() if fault == "agent" else pid
        os.kill(
            target,
            {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP, "agent": signal.SIGKILL}[fault],
        )
    try:
        in_flight.get(timeout=60)
        raise AssertionError(f"the in-flight call survived a {fault} fault")
    except SupervisionError as error:
        caller_at = time.time()
        if fault == "init":
            fault_at = error.event.time
    owner_seen.wait(10)
    procs.stop().get(timeout=30)
    if fault == "agent":
        this_host().shutdown()
    return (caller_at - fault_at) * 1e3, (seen_at[0] - fault_at) * 1e3 if seen_at else float("nan")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


FAULTS: dict[str, tuple[int, float]] = {  # kind: (trials, p99 target in ms)
    "sigkill": (20, 50.0),
    "exit": (20, 50.0),
    "init": (20, 50.0),
    "agent": (5, 50.0),
    "sigstop": (3, 3000.0),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer trials")
    args = parser.parse_args(argv)
    rows = []
    for fault, (trials, target) in FAULTS.items():
        n = max(2, trials // 4) if args.quick else trials
        results = [_trial(fault) for _ in range(n)]
        caller = [r[0] for r in results]
        owner = [r[1] for r in results]
        rows.append(
            {
                "fault": fault,
                "trials": n,
                "caller_p50_ms": statistics.median(caller),
                "caller_p99_ms": _percentile(caller, 0.99),
                "owner_p50_ms": statistics.median(owner),
                "owner_p99_ms": _percentile(owner, 0.99),
                "target_p99_ms": target,
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = (
        f"{'fault':10} {'n':>3} {'caller p50':>11} {'caller p99':>11} {'owner p50':>10} "
        f"{'owner p99':>10} {'target p99':>11}  verdict"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        ok = max(row["caller_p99_ms"], row["owner_p99_ms"]) <= row["target_p99_ms"]
        print(
            f"{row['fault']:10} {row['trials']:>3} {row['caller_p50_ms']:>9.1f}ms "
            f"{row['caller_p99_ms']:>9.1f}ms {row['owner_p50_ms']:>8.1f}ms "
            f"{row['owner_p99_ms']:>8.1f}ms {row['target_p99_ms']:>9.0f}ms  "
            f"{'PASS' if ok else 'MISS'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
