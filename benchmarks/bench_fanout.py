"""Calls to a whole mesh: fanned out through each host agent, against one message per actor.

For N = 1, 8, 32, 64 procs (one actor each) on one host (the local agent), and on 4 hosts (4
``meshvisor agent`` daemons on loopback tcp, one allocation): the latency of a call to all N
(median) and the rate of pipelined calls to all N (100 issued, then every get), each with
the fan-out (one message per host, answers batched back) and, as the baseline taken in the
same run on the same procs, with every message sent to its actor directly. The two take
turns, round after round, so that load on the machine falls on both alike.

    python3 benchmarks/bench_fanout.py [--sizes 1 8 32 64] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mesh
import mesh._engine.fanout as fanout
import mesh.testing
from mesh import Actor, HostMesh, attach, endpoint, this_host

HOSTS = 4
PIPELINED = 100
T = 120.0  # seconds: the bound on every wait


class Echo(Actor):
    @endpoint
    def ok(self, x: int) -> int:
        return x


@contextmanager
def fanning_out(enabled: bool) -> Iterator[None]:
    """Calls made inside go through the host agents (or, not `enabled`, straight to procs)."""
    saved = fanout.MIN_FANOUT
    fanout.MIN_FANOUT = saved if enabled else sys.maxsize
    try:
        yield
    finally:
        fanout.MIN_FANOUT = saved


def call_all_ms(actors: Any, calls: int) -> float:
    times = []
    for i in range(calls):
        start = time.perf_counter()
        actors.ok.call(i).get(timeout=T)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def pipelined_per_s(actors: Any) -> float:
    start = time.perf_counter()
    futures = [actors.ok.call(i) for i in range(PIPELINED)]
    for future in futures:
        future.get(timeout=T)
    return PIPELINED / (time.perf_counter() - start)


def measure(hosts: HostMesh, n: int, rounds: int) -> dict[str, Any]:
    """Both paths on the same N procs, taking turns: medians over `rounds`."""
    per_host = n // len(hosts)
    procs = hosts.spawn_procs(per_host={"gpus": per_host})
    try:
        actors = procs.spawn("echo", Echo)
        actors.ok.call(0).get(timeout=T)  # started, and its first messages answered
        results: dict[bool, dict[str, list[float]]] = {
            path: {"call": [], "pipelined": []} for path in (True, False)
        }
        calls = max(5, 200 // max(n, 1))
        for _ in range(rounds):
            for path in (True, False):
                with fanning_out(path):
                    actors.ok.call(0).get(timeout=T)  # warm: the routes settle on this path
                    results[path]["call"].append(call_all_ms(actors, calls))
                    results[path]["pipelined"].append(pipelined_per_s(actors))
    finally:
        procs.stop().get(timeout=T)
    row: dict[str, Any] = {"n": n, "hosts": len(hosts)}
    for path, name in ((True, "fanout"), (False, "direct")):
        row[f"{name}_call_all_ms"] = statistics.median(results[path]["call"])
        row[f"{name}_pipelined_per_s"] = statistics.median(results[path]["pipelined"])
    row["call_speedup"] = row["direct_call_all_ms"] / row["fanout_call_all_ms"]
    row["pipelined_speedup"] = row["fanout_pipelined_per_s"] / row["direct_pipelined_per_s"]
    return row


@contextmanager
def four_agents() -> Iterator[Path]:
    """HOSTS daemon agents on loopback tcp in one allocation file (yielded); stopped after."""
    folder = Path(tempfile.mkdtemp(prefix="meshvisor-bench-fanout-"))
    alloc = folder / "hosts"
    agents = []
    try:
        for i in range(HOSTS):
            (folder / f"run{i}").mkdir(mode=0o700)
            command = [sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"]
            command += ["--rundir", str(folder / f"run{i}"), "--allocation", str(alloc)]
            agents.append(subprocess.Popen(command))
        deadline = time.monotonic() + T
        while not alloc.exists() or len(alloc.read_text().split()) < HOSTS:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {HOSTS} agents did not join the allocation in {T} s")
            time.sleep(0.05)
        yield alloc
    finally:
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        for agent in agents:
            agent.wait(T)
        shutil.rmtree(folder, ignore_errors=True)


def report(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    print(
        f"{'N':>4} {'hosts':>5} | {'call all: fan-out':>17} {'direct':>9} {'speedup':>7} | "
        f"{'pipelined/s: fan-out':>20} {'direct':>9} {'speedup':>7}"
    )
    for r in rows:
        print(
            f"{r['n']:>4} {r['hosts']:>5} | {r['fanout_call_all_ms']:>14.2f} ms "
            f"{r['direct_call_all_ms']:>6.2f} ms {r['call_speedup']:>6.2f}x | "
            f"{r['fanout_pipelined_per_s']:>20.1f} {r['direct_pipelined_per_s']:>9.1f} "
            f"{r['pipelined_speedup']:>6.2f}x"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("MESHVISOR_LOG_LEVEL", "warning")
    mesh.configure(agent_timeout_s=30.0)  # agents busy forking 64 procs on 2 cores are alive
    rows = [measure(this_host(), n, args.rounds) for n in args.sizes]
    with four_agents() as alloc:
        hosts = attach(str(alloc))
        rows += [measure(hosts, n, args.rounds) for n in args.sizes if n >= HOSTS]
    mesh.testing.shutdown()
    report(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
