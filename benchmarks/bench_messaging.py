"""Messaging benchmark: what one message costs, beside the raw pyzmq floor, in one run.

    python3 benchmarks/bench_messaging.py            # a table
    python3 benchmarks/bench_messaging.py --json     # the same rows as JSON

Both sides are measured the same way: a raw pyzmq echo server (PUSH/PULL each way over ipc,
the floor `bench_foundation.py` uses) and a meshvisor proc with one actor whose endpoint
returns its argument. For each:

* the sync round trip: one call, wait for its answer, repeat (batches interleaved with the
  floor's, so that both see the same machine; the ratio is the median of per-batch ratios);
* pipelined calls: 5000 issued, then every answer collected (median of 5 bursts);
* the CPU time per message in the caller's process and in the callee's (all their threads,
  zmq's I/O thread included), from ``/proc``, over the pipelined bursts.

Targets (issue 17): pipelined >= 0.5x the raw pipelined echo; round trip <= 1.3x the raw
floor. A MISS is reported, not raised. Numbers only compare within one run: on a shared
2-core machine other load moves them by 2x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

os.environ.setdefault("MESHVISOR_LOG_LEVEL", "error")  # before meshvisor reads it

from bench_foundation import PIPELINE, RawEcho, Row, fmt_ratio, judge, print_table

from mesh import Actor, endpoint, this_host

_TICKS = os.sysconf("SC_CLK_TCK")


class Echo(Actor):
    """The callee: answers with its argument (defined in a script: it travels by value)."""

    @endpoint
    def ping(self, x: Any = None) -> Any:
        return x

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid`, all its threads, from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


class Side:
    """One way of making calls (raw or meshvisor): round trip, burst, and the callee's pid."""

    def __init__(
        self, round_trip: Callable[[], None], burst: Callable[[], float], callee_pid: int
    ) -> None:
        self.round_trip = round_trip
        self.burst = burst
        self.callee_pid = callee_pid


def raw_side(raw: RawEcho) -> Side:
    return Side(raw.round_trip, raw.pipelined, raw.child.pid)


def mesh_side(one: Any) -> Side:
    ping = one.ping

    def round_trip() -> None:
        ping.call_one(0).get()

    def burst() -> float:
        start = time.perf_counter()
        futures = [ping.call_one(i) for i in range(PIPELINE)]
        for future in futures:
            future.get(timeout=60)
        return PIPELINE / (time.perf_counter() - start)

    return Side(round_trip, burst, one.pid.call_one().get(timeout=60))


def batch_seconds(op: Callable[[], None], count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        op()
    return (time.perf_counter() - start) / count


def measure_round_trips(rows: list[Row], raw: Side, mesh: Side) -> None:
    for _ in range(300):
        raw.round_trip()
        mesh.round_trip()
    raw_batches, mesh_batches = [], []
    for _ in range(9):
        raw_batches.append(batch_seconds(raw.round_trip, 500))
        mesh_batches.append(batch_seconds(mesh.round_trip, 500))
    ratio = statistics.median(m / r for m, r in zip(mesh_batches, raw_batches, strict=True))
    note = "one 64-byte frame / ping(0); median of 9x500, batches interleaved"
    rows.append(Row("raw pyzmq round trip (floor)", statistics.median(raw_batches) * 1e6, "us"))
    row = Row(
        "meshvisor call_one round trip",
        statistics.median(mesh_batches) * 1e6,
        "us",
        vs_floor=fmt_ratio(ratio),
        note=note,
    )
    rows.append(judge(row, ratio <= 1.3, "<= 1.3x floor"))


def pipelined(side: Side) -> tuple[float, float, float]:
    """(messages per second, caller CPU us per message, callee CPU us per message)."""
    side.burst()
    me, callee = os.getpid(), side.callee_pid
    rates, mine, theirs = [], 0.0, 0.0
    for _ in range(5):
        before = cpu_seconds(me), cpu_seconds(callee)
        rates.append(side.burst())
        mine += cpu_seconds(me) - before[0]
        theirs += cpu_seconds(callee) - before[1]
    per = 1e6 / (5 * PIPELINE)
    return statistics.median(rates), mine * per, theirs * per


def measure_pipelined(rows: list[Row], raw: Side, mesh: Side) -> None:
    raw_rate, raw_mine, raw_theirs = pipelined(raw)
    rate, mine, theirs = pipelined(mesh)
    ratio = rate / raw_rate
    rows.append(Row(f"raw pyzmq pipelined echo ({PIPELINE} in flight)", raw_rate, "msg/s"))
    row = Row(
        f"meshvisor pipelined call_one ({PIPELINE} in flight)",
        rate,
        "calls/s",
        vs_floor=fmt_ratio(ratio),
        note="issue all, then get() all; median of 5",
    )
    rows.append(judge(row, ratio >= 0.5, ">= 0.5x floor"))
    for who, raw_us, mesh_us in (("caller", raw_mine, mine), ("callee", raw_theirs, theirs)):
        rows.append(Row(f"raw CPU per message, {who}", raw_us, "us"))
        rows.append(
            Row(
                f"meshvisor CPU per message, {who}",
                mesh_us,
                "us",
                vs_floor=fmt_ratio(mesh_us / raw_us if raw_us else None),
                note="all threads of the process, over the 5 pipelined bursts (/proc, "
                f"{1e6 / _TICKS:.0f} us ticks)",
            )
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="meshvisor-bench-") as scratch:
        raw = RawEcho(scratch)
        host = this_host()
        try:
            one = host.spawn_procs(per_host={"procs": 1}, name="one").spawn("echo", Echo)
            raw_calls, mesh_calls = raw_side(raw), mesh_side(one)
            measure_round_trips(rows, raw_calls, mesh_calls)
            measure_pipelined(rows, raw_calls, mesh_calls)
        finally:
            host.shutdown().get(timeout=30)  # stops the agent and every proc it runs
            raw.close()
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps({"elapsed_s": round(elapsed, 2), "rows": [asdict(r) for r in rows]}))
    else:
        print_table(rows, elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
