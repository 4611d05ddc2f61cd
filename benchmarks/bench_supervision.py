"""Failure detection latency: from a fault to the caller's SupervisionError and to the owner.

For each fault kind, a fresh proc runs an actor with a call in flight (a 60 s sleep); the fault
is injected and two times are recorded: when the in-flight call raised SupervisionError (the
caller) and when the mesh's on_failure handler ran (the owner). Prints a table of p50/p99 in
milliseconds; --json for machines. Targets (issue #3): p99 <= 50 ms for deaths, <= 3 s for
hangs with the default heartbeat settings.

Then false hangs (issue #10): procs that work (long C calls that hold the GIL, and Python code)
with the default heartbeat settings while busy loops oversubscribe the cores 4x; it counts the
procs reported hung although they were making progress (target: 0), with the default busy
limit and, for comparison, with the busy limit equal to the heartbeat timeout (the behaviour
before busy procs were told from hung ones).
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
from typing import Any

from mesh import Actor, endpoint, this_host
from supervision import SupervisionError, SupervisionEvent


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


class Worker(Actor):
    """Makes progress in ways that delay heartbeats: a long C call that holds the GIL (a
    native kernel), then pure-Python work."""

    @endpoint
    def work(self, c_call_cpu_s: float) -> int:
        sample = 2_000_000
        started = time.process_time()
        sum(range(sample))  # builtin sum over a range: one C loop, the GIL held throughout
        per_item = max(time.process_time() - started, 1e-5) / sample
        sum(range(int(c_call_cpu_s / per_item)))
        count, until = 0, time.process_time() + 0.1
        while time.process_time() < until:
            count += 1
        return count


def _false_hangs(busy_timeout_s: float | None, seconds: float, procs_n: int) -> dict[str, float]:
    """`procs_n` procs keep calling `Worker.work` for `seconds` while busy loops bring the
    runnable processes to 4x the cores; returns how many procs were reported hung."""
    cores = os.cpu_count() or 1
    hogs_n = max(0, 4 * cores - procs_n)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs_n)]
    hung: list[SupervisionEvent] = []
    procs = this_host().spawn_procs(
        per_host={"rank": procs_n}, name="bench-hog", busy_timeout_s=busy_timeout_s
    )
    procs.on_failure(lambda event: hung.append(event) or True)
    try:
        workers = procs.spawn("worker", Worker)
        workers.work.call(0.0).get(timeout=120)  # all up before the clock starts
        calls = _keep_working([workers.slice(rank=r) for r in range(procs_n)], seconds)
    finally:
        procs.stop().get(timeout=60)
        for hog in hogs:
            hog.kill()
            hog.wait()
    return {
        "procs": procs_n,
        "hogs": hogs_n,
        "cores": cores,
        "seconds": seconds,
        "calls": calls,
        "hung": float(len({e.proc_id for e in hung if e.kind == "hung"})),
    }


def _keep_working(ranks: list[Any], seconds: float) -> int:
    """Keep one `work` call in flight on every rank for `seconds` (a rank declared hung drops
    out), then let the last calls finish; returns the number of calls that succeeded."""
    calls, until = 0, time.monotonic() + seconds
    in_flight = {r: mesh.work.call_one(1.0) for r, mesh in enumerate(ranks)}
    while in_flight and time.monotonic() < until:
        for r, future in list(in_flight.items()):
            if future.done():
                del in_flight[r]
                if future.exception() is None:
                    calls += 1
                    in_flight[r] = ranks[r].work.call_one(1.0)
        time.sleep(0.05)
    for future in in_flight.values():
        try:
            future.get(timeout=300)
            calls += 1
        except SupervisionError:
            pass
    return calls


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
        fault_at = time.time() + 0.2  # from now: spawning may take long on a busy machine
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


#: Busy limits compared for false hangs: the default, and the heartbeat timeout (as before).
BUSY_LIMITS: dict[str, float | None] = {"default (60 s)": None, "= heartbeat timeout": 2.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer trials, shorter hog runs")
    parser.add_argument(
        "--only", choices=("detection", "false-hangs"), help="run one part of the benchmark"
    )
    args = parser.parse_args(argv)
    rows = _detection_rows(args.quick) if args.only != "false-hangs" else []
    hog_rows = _false_hang_rows(args.quick) if args.only != "detection" else []
    if args.json:
        print(json.dumps({"detection": rows, "false_hangs": hog_rows}, indent=2))
        return 0
    if rows:
        _print_detection(rows)
    if hog_rows:
        _print_false_hangs(hog_rows)
    return 0


def _detection_rows(quick: bool) -> list[dict[str, float | str]]:
    rows: list[dict[str, float | str]] = []
    for fault, (trials, target) in FAULTS.items():
        n = max(2, trials // 4) if quick else trials
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
    return rows


def _false_hang_rows(quick: bool) -> list[dict[str, float | str]]:
    seconds = 10.0 if quick else 30.0
    return [
        {"busy_limit": label, **_false_hangs(limit, seconds, procs_n=4)}
        for label, limit in BUSY_LIMITS.items()
    ]


def _print_detection(rows: list[dict[str, Any]]) -> None:
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


def _print_false_hangs(rows: list[dict[str, Any]]) -> None:
    first = rows[0]
    print(
        f"\nfalse hangs: {first['procs']} working procs + {first['hogs']} busy loops on "
        f"{first['cores']} cores (4x), default heartbeats, {first['seconds']:g} s"
    )
    header = f"{'busy limit':22} {'calls':>6} {'hung':>5} {'target':>7}  verdict"
    print(header)
    print("-" * len(header))
    for row in rows:
        default = row["busy_limit"] == next(iter(BUSY_LIMITS))
        verdict = ("PASS" if row["hung"] == 0 else "MISS") if default else "(compare)"
        target = "0" if default else "-"
        print(
            f"{row['busy_limit']:22} {row['calls']:>6} {row['hung']:>5.0f} {target:>7}  {verdict}"
        )


if __name__ == "__main__":
    sys.exit(main())
