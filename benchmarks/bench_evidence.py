"""What capturing a hung proc's stacks adds to its detection.

For each way of hanging (SIGSTOP; a C call holding the GIL), a fresh proc with a call in
flight and fast heartbeats (0.1 s interval, 1 s timeout): the time from the fault to the
call's SupervisionError, and the part of it spent on the stack dump (from the agent's dump
request to the proc's exit, as the event says). The baseline, in the same run: a proc
SIGKILLed with a call in flight, from the kill to the SupervisionError (what a kill alone
costs end to end, which a hung proc paid before the dump).

    python3 benchmarks/bench_evidence.py [--reps N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import failing_actors as fa

from mesh import this_host
from supervision import SupervisionError

HB = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0}
_DUMPED = re.compile(r"stacks were dumped in ([0-9]+) ms")


def _one(how: str, scratch: str) -> tuple[float, float | None]:
    """(fault → SupervisionError seconds, dump seconds or None) for one fresh proc."""
    procs = this_host().spawn_procs(per_host={"gpus": 1}, **HB)
    procs.on_failure(lambda event: True)
    try:
        actors = procs.spawn("bench", fa.Fragile)
        pid = actors.pid.call_one().get(timeout=30)
        marker = os.path.join(scratch, f"nap-{pid}")
        if how == "gil":
            in_flight = actors.hold_gil.call_one(600)
            start = time.monotonic()
        else:
            in_flight = actors.nap.call_one(marker, 600)
            while not os.path.exists(marker):
                time.sleep(0.001)
            start = time.monotonic()
            os.kill(pid, signal.SIGSTOP if how == "sigstop" else signal.SIGKILL)
        try:
            in_flight.get(timeout=60)
        except SupervisionError as error:
            took = time.monotonic() - start
            found = _DUMPED.search(error.event.message)
            return took, float(found[1]) / 1e3 if found else None
        raise RuntimeError(f"{how}: the call returned instead of failing")
    finally:
        procs.stop().get(timeout=30)


def _median_ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1e3, 1) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mvt-bench-") as scratch:
        for how in ("sigkill", "sigstop", "gil"):
            results = [_one(how, scratch) for _ in range(args.reps)]
            dumps = [dump for _, dump in results if dump is not None]
            rows.append(
                {
                    "fault": how,
                    "fault_to_error_ms_p50": _median_ms([took for took, _ in results]),
                    "dump_ms_p50": _median_ms(dumps),
                    "dumped": f"{len(dumps)}/{len(results)}",
                }
            )
    baseline = rows[0]["fault_to_error_ms_p50"]
    for row in rows[1:]:
        dump, total = row["dump_ms_p50"], row["fault_to_error_ms_p50"]
        row["dump_vs_sigkill_to_error"] = round(dump / baseline, 2) if dump and baseline else None
        row["dump_share_of_detection"] = round(dump / total, 3) if dump and total else None
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"{'fault':<8} {'fault->error ms':>16} {'dump ms':>9} {'dumped':>7} {'dump/kill':>10} "
        f"{'dump/detection':>15}"
    )
    for row in rows:
        ratio, share = row.get("dump_vs_sigkill_to_error"), row.get("dump_share_of_detection")
        print(
            f"{row['fault']:<8} {row['fault_to_error_ms_p50']!s:>16} {row['dump_ms_p50']!s:>9} "
            f"{row['dumped']:>7} {ratio!s:>10} {share!s:>15}"
        )


if __name__ == "__main__":
    main()
