"""Calls to a whole mesh: fanned out through each host agent, against one message per actor.

For N = 1, 8, 32, 64 procs (one actor each) on one host (the local agent), and on 4 hosts (4
``meshvisor agent`` daemons on loopback tcp, one allocation): the latency of a call to all N
(median) and the rate of pipelined calls to all N (100 issued, then every get), each with
the fan-out (one message per host, answers batched back) and, as the baseline taken in the
same run on the same procs, with every message sent to its actor directly. The two take
turns, round after round, so that load on the machine falls on both alike. Beside the times,
the CPU each call costs this client and the other processes (agents and procs, from /proc):
on a loaded machine wall times wander, CPU per call much less.

Then large arguments (1 and 64 MB, bytes and a tensor) to all N procs of one host: shared
(the agent writes it once into shared memory the procs read), against sent to each proc
directly, beside the floor of one memcpy of the argument per proc, timed in this process in
the same run, into fresh buffers ("memcpy") and into reused warm memory ("warm").

    python3 benchmarks/bench_fanout.py [--sizes 1 8 32 64] [--rounds 5] [--json]
        [--payload-procs 8 32] [--payload-mb 1 64]
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
import mesh.testing
from mesh import Actor, HostMesh, attach, endpoint, this_host
from mesh.testing import fan_out_from

HOSTS = 4
PIPELINED = 100
T = 120.0  # seconds: the bound on every wait


class Echo(Actor):
    @endpoint
    def ok(self, x: int) -> int:
        return x

    @endpoint
    def length(self, data: Any) -> int:
        return len(data)


def descendants_cpu_s() -> float:
    """CPU seconds used so far by the processes this one started (agents, fork servers,
    procs), alive ones only: read from /proc."""
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:  # it ended meanwhile
                continue
            parents[int(name)] = int(fields[1])
            used[int(name)] = (int(fields[11]) + int(fields[12])) / tick
    ours, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in ours} - ours
        ours |= more
        grew = bool(more)
    return sum(used[pid] for pid in ours if pid != os.getpid())


def timed(work: Any, count: int) -> tuple[float, float, float]:
    """(wall ms, this client's CPU ms, the other processes' CPU ms) per unit of `work()`,
    which does `count` units."""
    others, client, start = descendants_cpu_s(), time.process_time(), time.perf_counter()
    work()
    wall, client = time.perf_counter() - start, time.process_time() - client
    others = descendants_cpu_s() - others
    return wall * 1e3 / count, client * 1e3 / count, others * 1e3 / count


def call_all(actors: Any, calls: int) -> tuple[float, float, float]:
    """Calls to all, one after the other: the median wall time, and the CPU per call."""
    walls: list[float] = []

    def work() -> None:
        for i in range(calls):
            start = time.perf_counter()
            actors.ok.call(i).get(timeout=T)
            walls.append((time.perf_counter() - start) * 1e3)

    _, client, others = timed(work, calls)
    return statistics.median(walls), client, others


def pipelined(actors: Any) -> tuple[float, float, float]:
    """PIPELINED calls to all issued, then every get: calls per second, and CPU per call."""

    def work() -> None:
        futures = [actors.ok.call(i) for i in range(PIPELINED)]
        for future in futures:
            future.get(timeout=T)

    wall, client, others = timed(work, PIPELINED)
    return 1e3 / wall, client, others


FIGURES = (
    *("call_ms", "call_client_cpu_ms", "call_other_cpu_ms"),
    *("pipelined_per_s", "pipelined_client_cpu_ms", "pipelined_other_cpu_ms"),
)


def measure(hosts: HostMesh, n: int, rounds: int) -> dict[str, Any]:
    """Both paths on the same N procs, taking turns: medians over `rounds`."""
    per_host = n // len(hosts)
    procs = hosts.spawn_procs(per_host={"gpus": per_host})
    try:
        actors = procs.spawn("echo", Echo)
        actors.ok.call(0).get(timeout=T)  # started, and its first messages answered
        results: dict[str, list[tuple[float, ...]]] = {"fanout": [], "direct": []}
        calls = max(5, 200 // max(n, 1))
        for _ in range(rounds):
            for path in ("fanout", "direct"):
                with fan_out_from(1 if path == "fanout" else sys.maxsize):
                    actors.ok.call(0).get(timeout=T)  # warm: the routes settle on this path
                    results[path].append((*call_all(actors, calls), *pipelined(actors)))
    finally:
        procs.stop().get(timeout=T)
    row: dict[str, Any] = {"n": n, "hosts": len(hosts)}
    for path, rounds_of in results.items():
        for index, figure in enumerate(FIGURES):
            row[f"{path}_{figure}"] = statistics.median(r[index] for r in rounds_of)
    return row


def memcpy_ms(data: bytes, copies: int, fresh: bool = True) -> float:
    """The floor: `copies` copies of `data` in this process, in ms (best of 3). `fresh`:
    each into a new buffer kept until all are made (as each proc keeps its own), paying for
    new pages; else each buffer freed before the next copy, which reuses warm memory."""
    best = float("inf")
    for _ in range(3):
        kept = []
        start = time.perf_counter()
        for _ in range(copies):
            copy = bytearray(data)
            if fresh:
                kept.append(copy)
        best = min(best, time.perf_counter() - start)
        del kept, copy
    return best * 1e3


def measure_payload(n: int, megabytes: int, kind: str, rounds: int) -> dict[str, Any]:
    """A `megabytes` argument (`kind`: bytes, which the procs copy out, or a uint8 tensor,
    which they do not) to all `n` procs of this host: shared vs direct vs memcpy floor, and
    the same call with an empty argument (medians over `rounds`, all taking turns)."""
    raw = os.urandom(megabytes << 20)
    data: Any = raw
    if kind == "tensor":
        import torch

        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    procs = this_host().spawn_procs(per_host={"gpus": n})
    times: dict[str, list[float]] = {
        "shared": [],
        "direct": [],
        "memcpy": [],
        "warm": [],
        "empty": [],
    }
    try:
        actors = procs.spawn("sizes", Echo)
        actors.ok.call(0).get(timeout=T)
        for _ in range(rounds):
            for path in ("shared", "direct"):
                with fan_out_from(1 if path == "shared" else sys.maxsize):
                    actors.ok.call(0).get(timeout=T)  # the routes settle on this path
                    start = time.perf_counter()
                    actors.length.call(data).get(timeout=T)
                    times[path].append((time.perf_counter() - start) * 1e3)
                    if path == "shared":  # the same call with no argument to speak of
                        start = time.perf_counter()
                        actors.length.call(b"").get(timeout=T)
                        times["empty"].append((time.perf_counter() - start) * 1e3)
            times["memcpy"].append(memcpy_ms(raw, n))
            times["warm"].append(memcpy_ms(raw, n, fresh=False))
    finally:
        procs.stop().get(timeout=T)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"n": n, "mb": megabytes, "kind": kind, **medians}


def report_payloads(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        for row in rows:
            print(json.dumps(row))
        return
    print("a large argument to all N procs of one host, per call (ms); memcpy: N copies into")
    print("fresh buffers (new pages), warm: N copies reusing one buffer")
    columns = ("shared", "direct", "memcpy", "warm", "empty")
    print(
        f"{'N':>3} {'MB':>3} {'kind':>6} | " + " ".join(f"{c:>8}" for c in columns) + " | "
        "vs memcpy: shared direct | shared - empty vs memcpy"
    )
    for r in rows:
        floor = r["memcpy"]
        ratios = (r["shared"] / floor, r["direct"] / floor, (r["shared"] - r["empty"]) / floor)
        print(
            f"{r['n']:>3} {r['mb']:>3} {r['kind']:>6} | "
            + " ".join(f"{r[c]:>8.2f}" for c in columns)
            + f" | {ratios[0]:>17.2f}x {ratios[1]:>5.2f}x | {ratios[2]:>24.2f}x"
        )


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
    print("per call to all N: fan-out / direct (direct: every message sent to its actor)")
    print(
        f"{'N':>3} {'hosts':>5} | {'call ms':>13} {'x':>5} | {'client CPU ms':>13} {'x':>5} | "
        f"{'others CPU ms':>13} | {'pipelined/s':>13} {'x':>5} | {'client CPU ms':>13} "
        f"{'x':>5} | {'others CPU ms':>13}"
    )
    for r in rows:
        cells = []
        for figure, higher_is_better in (
            ("call_ms", False),
            ("call_client_cpu_ms", False),
            ("call_other_cpu_ms", None),
            ("pipelined_per_s", True),
            ("pipelined_client_cpu_ms", False),
            ("pipelined_other_cpu_ms", None),
        ):
            ours, base = r[f"fanout_{figure}"], r[f"direct_{figure}"]
            cell = f"{ours:>6.2f}/{base:<6.2f}"
            if higher_is_better is not None:
                gain = ours / base if higher_is_better else base / ours
                cell += f" {gain:>4.2f}x"
            cells.append(cell)
        print(f"{r['n']:>3} {r['hosts']:>5} | " + " | ".join(cells))
    print("x: the fan-out's gain over direct (>1: better); others: agents and procs together")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--payload-procs", type=int, nargs="*", default=[8, 32])
    parser.add_argument("--payload-mb", type=int, nargs="*", default=[1, 64])
    args = parser.parse_args()
    os.environ.setdefault("MESHVISOR_LOG_LEVEL", "warning")
    mesh.configure(agent_timeout_s=30.0)  # agents busy forking 64 procs on 2 cores are alive
    rows = [measure(this_host(), n, args.rounds) for n in args.sizes]
    payloads = [
        measure_payload(n, mb, kind, args.rounds)
        for n in args.payload_procs
        for mb in args.payload_mb
        for kind in ("bytes", "tensor")
    ]
    if any(n >= HOSTS for n in args.sizes):
        with four_agents() as alloc:
            hosts = attach(str(alloc))
            rows += [measure(hosts, n, args.rounds) for n in args.sizes if n >= HOSTS]
    mesh.testing.shutdown()
    report(rows, args.json)
    report_payloads(payloads, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
