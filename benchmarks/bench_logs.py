"""Logs at scale: what keeping and streaming a chatty job's output costs.

N ranks print L lines each as fast as they can (``print`` in a loop). Each row is one way of
handling those lines; the baselines, taken in the same run, are the same procs printing to
/dev/null and to a plain file of their own (no relay at all). For each row: how long the procs
took to print (a slow relay shows here: a full pipe makes ``print`` wait), how long until every
line was handled (in the log files, and shown at the client where streamed: ``flush_logs``),
the lines/s that makes, the CPU time of the host agent and its fork server (which relays the
lines and writes the per-rank files), and the ratios to the /dev/null baseline.

    python3 benchmarks/bench_logs.py [--ranks N] [--lines L] [--reps R] [--json]

Each row is the best of R runs (the machine's other load only ever adds time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mesh import Actor, endpoint, this_host
from mesh.testing import stop_local_agent


class Chatty(Actor):
    @endpoint
    def chat(self, lines: int, to: str | None) -> float:
        """Print `lines` lines (to `to` instead of stdout if given); the seconds it took."""
        target = open(to, "w", buffering=1) if to else sys.stdout  # noqa: SIM115
        started = time.perf_counter()
        for index in range(lines):
            print(f"step {index} loss {0.5 + index * 1e-7:.7f}", file=target)
        if to:
            target.close()
        return time.perf_counter() - started


class _Counter:
    """Stands in for the client's stdout: counts the lines shown, keeps none."""

    def __init__(self) -> None:
        self.lines = 0

    def write(self, text: str) -> int:
        self.lines += text.count("\n")
        return len(text)

    def flush(self) -> None:
        pass


@dataclass
class Row:
    handling: str
    print_s: float
    handled_s: float
    lines_per_s: float
    shown_lines: int
    agent_cpu_s: float
    print_ratio: float = 1.0
    handled_ratio: float = 1.0


#: (name, files kept, logging_option arguments or None, where procs print instead of stdout)
CASES: list[tuple[str, bool, dict[str, Any] | None, str | None]] = [
    ("baseline: print to /dev/null", True, None, "/dev/null"),
    ("baseline: print to a plain file", True, None, "file"),
    ("agent output, no log files", False, None, None),
    ("agent output + log files (default)", True, None, None),
    ("files only (stream_to_client=False)", True, {"stream_to_client": False}, None),
    ("to client, no aggregation", True, {"aggregate_window_sec": None}, None),
    ("to client, aggregated (identical)", True, {"aggregate_similar": False}, None),
    ("to client, aggregated (similar)", True, {}, None),
]


def _agent_cpu_s() -> float:
    """CPU seconds of this process's host agents and their fork servers so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    agents = _children_of(os.getpid())
    for pid in [*agents, *(child for agent in agents for child in _children_of(agent))]:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def _children_of(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _run_case(
    ranks: int, lines: int, options: dict[str, Any] | None, to: str | None, scratch: str
) -> tuple[float, float, int, float]:
    procs = this_host().spawn_procs(per_host={"gpus": ranks}, name="chatty")
    try:
        chatty = procs.spawn("chatty", Chatty)
        chatty.chat.call(0, None).get(timeout=120)  # started and ready
        if options is not None:
            window = {"aggregate_window_sec": 1.0} | options
            if window.get("stream_to_client") is False:
                window["aggregate_window_sec"] = None
            procs.logging_option(**window).get(timeout=120)
        counter = _Counter()
        real_stdout, sys.stdout = sys.stdout, counter  # type: ignore[assignment]
        cpu_before = _agent_cpu_s()
        started = time.perf_counter()
        try:
            target = f"{scratch}/out" if to == "file" else to
            per_rank = chatty.chat.call(lines, target).get(timeout=600).values()
            procs.flush_logs().get(timeout=600)
            handled = time.perf_counter() - started
        finally:
            sys.stdout = real_stdout
        return max(per_rank), handled, counter.lines, _agent_cpu_s() - cpu_before
    finally:
        procs.stop().get(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--lines", type=int, default=50_000, help="lines per rank")
    parser.add_argument("--reps", type=int, default=3, help="runs per row; the best is kept")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshvisor-bench-logs-") as scratch:
        os.environ["MESHVISOR_LOG_DIR"] = f"{scratch}/logs"
        saved_stdout = os.dup(1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # the agents' own output (lines not streamed) goes nowhere
        try:
            for name, files, options, to in CASES:
                os.environ["MESHVISOR_LOG_FILES"] = "5" if files else "0"
                stop_local_agent()  # the next this_host() starts one with these settings
                runs = [
                    _run_case(args.ranks, args.lines, options, to, scratch)
                    for _ in range(args.reps)
                ]
                printed, handled, shown, cpu = min(runs, key=lambda run: run[1])
                total = args.ranks * args.lines
                rows.append(Row(name, printed, handled, total / handled, shown, cpu))
        finally:
            stop_local_agent()
            os.dup2(saved_stdout, 1)
    for row in rows:
        row.print_ratio = row.print_s / rows[0].print_s
        row.handled_ratio = row.handled_s / rows[0].handled_s
    if args.json:
        print(json.dumps([asdict(row) for row in rows], indent=2))
        return
    _print_table(rows, args.ranks, args.lines)


def _print_table(rows: list[Row], ranks: int, lines: int) -> None:
    print(f"{ranks} ranks x {lines} lines each; best of several runs; x: ratio to the first row")
    print(
        f"{'handling':<38} {'print s':>8} {'x':>6} {'handled s':>10} {'x':>6} "
        f"{'lines/s':>10} {'shown':>8} {'agent cpu s':>12}"
    )
    for r in rows:
        print(
            f"{r.handling:<38} {r.print_s:>8.2f} {r.print_ratio:>6.2f} {r.handled_s:>10.2f} "
            f"{r.handled_ratio:>6.2f} {r.lines_per_s:>10.0f} {r.shown_lines:>8} "
            f"{r.agent_cpu_s:>12.2f}"
        )


if __name__ == "__main__":
    main()
