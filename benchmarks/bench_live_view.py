"""What the live view costs the host agent: its CPU with ``meshvisor top`` attached, vs not.

A client runs N idle procs (one actor each: the agent's only work is their heartbeats). The
agent's CPU time (``/proc``) is measured over equal windows: detached (the baseline, in the
same run), with a viewer taking a snapshot every second (``meshvisor top``'s default), and
every 0.1 s (a stress figure); the windows alternate, and each figure is the median of the
rounds. From these, the agent's CPU per snapshot (the extra over detached, per snapshot taken),
and the time to take one snapshot (query to answer, p50/p99). Prints a table; the target is
that a view at 1 Hz adds at most 10 % to the CPU of an agent whose procs are idle (the CPU
clock ticks every 10 ms: use long windows on a busy machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from mesh import Actor, endpoint, this_host
from observe._snapshot import SnapshotReader
from observe._targets import client_target

TARGET_RATIO_1HZ = 1.10
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


class Idle(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _window(
    agent_pid: int, reader: SnapshotReader, every_s: float | None, seconds: float
) -> tuple[float, list[float]]:
    """The agent's CPU seconds per second over `seconds`, taking a snapshot every `every_s`
    (None: none), and the snapshot times."""
    took: list[float] = []
    start_cpu, start = _cpu_s(agent_pid), time.monotonic()
    end = start + seconds
    while (now := time.monotonic()) < end:
        if every_s is None:
            time.sleep(end - now)
            continue
        began = time.perf_counter()
        snapshot = reader.take(timeout_s=5.0)
        took.append(time.perf_counter() - began)
        assert snapshot.hosts, f"the agent did not answer: {snapshot.unreachable}"
        time.sleep(max(0.0, every_s - (time.perf_counter() - began)))
    return (_cpu_s(agent_pid) - start_cpu) / (time.monotonic() - start), took


def run(procs_count: int, rounds: int, seconds: float) -> list[dict[str, object]]:
    procs = this_host().spawn_procs(per_host={"procs": procs_count}, name="bench")
    procs.spawn("idle", Idle).pid.call().get(timeout=60)
    modes: dict[str, float | None] = {"detached": None, "top at 1 Hz": 1.0, "top at 10 Hz": 0.1}
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    took: dict[str, list[float]] = {mode: [] for mode in modes}
    try:
        with SnapshotReader(client_target(os.getpid())) as reader:
            agent_pid = reader.take(timeout_s=10.0).hosts[0].agent_pid
            time.sleep(2.0)  # the procs settle: imports done, heartbeats steady
            for _ in range(rounds):
                for mode, every_s in modes.items():
                    used, times = _window(agent_pid, reader, every_s, seconds)
                    cpu[mode].append(used)
                    took[mode].extend(times)
    finally:
        procs.stop().get(timeout=60)
    base = statistics.median(cpu["detached"])
    rows: list[dict[str, object]] = []
    for mode in modes:
        used = statistics.median(cpu[mode])
        times = sorted(took[mode]) or [0.0]
        rows.append(
            {
                "mode": mode,
                "procs": procs_count,
                "agent_cpu_ms_per_s": round(used * 1e3, 2),
                "ratio_vs_detached": round(used / base, 3) if base > 0 else None,
                "agent_ms_per_snapshot": (
                    round((used - base) * every_s * 1e3, 2) if (every_s := modes[mode]) else None
                ),
                "snapshot_p50_ms": round(statistics.median(times) * 1e3, 2),
                "snapshot_p99_ms": round(
                    times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3, 2
                ),
                "snapshots": len(took[mode]),
            }
        )
    return rows


def _table(rows: list[dict[str, object]]) -> None:
    header = (
        "mode",
        "procs",
        "agent CPU ms/s",
        "x detached",
        "agent ms/snapshot",
        "snapshot p50 ms",
        "p99 ms",
        "n",
    )
    keys = (
        *("mode", "procs", "agent_cpu_ms_per_s", "ratio_vs_detached", "agent_ms_per_snapshot"),
        *("snapshot_p50_ms", "snapshot_p99_ms", "snapshots"),
    )
    cells = [header] + [tuple(str(row[key]) for key in keys) for row in rows]
    widths = [max(len(line[k]) for line in cells) for k in range(len(header))]
    for line in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
    at_1hz = [row for row in rows if row["mode"] == "top at 1 Hz"]
    for row in at_1hz:
        ratio = row["ratio_vs_detached"]
        verdict = "PASS" if isinstance(ratio, float) and ratio <= TARGET_RATIO_1HZ else "MISS"
        print(
            f"{verdict}: {row['procs']} procs, a 1 Hz view costs x{ratio} "
            f"(target <= x{TARGET_RATIO_1HZ})"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--procs", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="length of one window")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [row for count in args.procs for row in run(count, args.rounds, args.seconds)]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        _table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
