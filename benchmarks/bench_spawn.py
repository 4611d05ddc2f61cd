"""Spawning many procs: how the time to start N procs grows with N, beside a raw floor.

    python3 benchmarks/bench_spawn.py                  # N = 1, 8, 32, 64; a table
    python3 benchmarks/bench_spawn.py --sizes 8 32 --reps 5 --json

Per N, in one run (medians of `--reps`):

* floor: a process that has imported what a fork server imports forks N children; each opens
  a zmq socket and tells the parent it is ready; until all N said so. What a proc cannot
  avoid: a fork and one message.
* one host: ``this_host().spawn_procs({"procs": N})`` with one actor per proc, until a
  ``call()`` to all N answers (the agent is warm: started before the clock starts).
* 4 hosts: the same spread over 4 local agents (`job.ProcessJob`, N/4 procs each; N = 1 is
  left out).

Each row gives the wall time and the CPU time of every process involved (the floor's parent
and children; the client, its agents, their fork servers and the procs), each beside the
floor's: on a shared machine the CPU time is the steadier figure. Exit status 0 unless a
measurement failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

os.environ.setdefault("MESHVISOR_LOG_LEVEL", "error")  # before meshvisor reads it

from job import ProcessJob
from mesh import Actor, HostMesh, endpoint, this_host

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Row:
    n: int
    hosts: int
    floor_ms: float
    spawn_ms: float
    floor_cpu_ms: float
    spawn_cpu_ms: float

    @property
    def wall_ratio(self) -> float:
        return self.spawn_ms / self.floor_ms

    @property
    def cpu_ratio(self) -> float:
        return self.spawn_cpu_ms / self.floor_cpu_ms


class Worker(Actor):
    @endpoint
    def ok(self, x: int) -> int:
        return x


# -- CPU time of a process tree ----------------------------------------------------------------


def _cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def _tree_cpu() -> dict[int, float]:
    """CPU seconds of this process and each of its live descendants, by pid."""
    pids = [os.getpid(), *_descendants(os.getpid())]
    return {pid: cpu for pid in pids if (cpu := _cpu_s(pid)) is not None}


def _cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


# -- the floor -----------------------------------------------------------------------------------


def floor_main(n: int, reps: int) -> None:
    """In a fresh interpreter: import what a fork server does, then `reps` times fork `n`
    children that each say ready over zmq; print (wall s, CPU s) pairs as JSON."""
    import resource

    import zmq

    import mesh._agent.daemon  # noqa: F401  (what the fork server has imported)
    from mesh._agent.warm_start import import_shared, warm_up

    import_shared()
    warm_up()
    context = zmq.Context()
    results = []
    with tempfile.TemporaryDirectory(prefix="mvbench-") as folder:
        address = f"ipc://{folder}/floor"
        pull = context.socket(zmq.PULL)
        pull.bind(address)
        for _ in range(reps):
            start_cpu = resource.getrusage(resource.RUSAGE_SELF)
            start_children = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            release_read, release_write = os.pipe()
            pids = [_fork_floor_child(address, (release_read, release_write)) for _ in range(n)]
            for _ in range(n):
                pull.recv()
            wall = time.perf_counter() - start
            os.close(release_write)  # the children exit
            os.close(release_read)
            for pid in pids:
                os.waitpid(pid, 0)
            end_cpu = resource.getrusage(resource.RUSAGE_SELF)
            end_children = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = sum(
                getattr(end, field) - getattr(begin, field)
                for end, begin in ((end_cpu, start_cpu), (end_children, start_children))
                for field in ("ru_utime", "ru_stime")
            )
            results.append((wall, cpu))
        pull.close(linger=0)
    context.term()
    print(json.dumps(results))


def _fork_floor_child(address: str, release: tuple[int, int]) -> int:
    pid = os.fork()
    if pid:
        return pid
    import zmq

    try:
        os.close(release[1])
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.connect(address)
        push.send(str(os.getpid()).encode())
        os.read(release[0], 1)  # until the parent is done: every child lives at the same time
        push.close(linger=1000)
        context.term()
    finally:
        os._exit(0)


def measure_floor(n: int, reps: int) -> tuple[float, float]:
    done = subprocess.run(
        [sys.executable, __file__, "--floor", str(n), str(reps)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    pairs = json.loads(done.stdout.splitlines()[-1])
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


# -- meshvisor -----------------------------------------------------------------------------------


def measure_spawn(hosts: HostMesh, per_host: int, reps: int) -> tuple[float, float]:
    """Median wall and CPU seconds to spawn `per_host` procs on each of `hosts` with one actor
    each, until a call to all answers."""
    walls, cpus = [], []
    for rep in range(reps + 1):  # the first one warms the agents up
        before = _tree_cpu()
        start = time.perf_counter()
        procs = hosts.spawn_procs({"procs": per_host})
        procs.spawn("workers", Worker).ok.call(0).get(timeout=300)
        wall = time.perf_counter() - start
        cpu = _cpu_spent(before, _tree_cpu())
        procs.stop().get(timeout=120)
        if rep:
            walls.append(wall)
            cpus.append(cpu)
    return statistics.median(walls), statistics.median(cpus)


def run(sizes: list[int], reps: int) -> list[Row]:
    rows = []
    floors = {n: measure_floor(n, reps) for n in sizes}
    local = this_host()
    for n in sizes:
        rows.append(Row(n, 1, *_in_ms(floors[n], measure_spawn(local, n, reps))))
    job = ProcessJob({"hosts": 4})
    try:
        spread = job.state(timeout_s=120).hosts
        for n in sizes:
            if n >= 4:
                rows.append(Row(n, 4, *_in_ms(floors[n], measure_spawn(spread, n // 4, reps))))
        spread.shutdown().get(timeout=60)  # expected to go: not reported as lost
    finally:
        job.kill()
    return rows


def _in_ms(floor: tuple[float, float], spawn: tuple[float, float]) -> tuple[float, ...]:
    return floor[0] * 1e3, spawn[0] * 1e3, floor[1] * 1e3, spawn[1] * 1e3


def print_table(rows: list[Row]) -> None:
    head = f"{'N':>4} {'hosts':>5} | {'floor ms':>9} {'spawn ms':>9} {'x floor':>8} |"
    print(head + f" {'floor CPU ms':>12} {'spawn CPU ms':>12} {'x floor':>8}")
    for r in rows:
        wall = f"{r.floor_ms:9.1f} {r.spawn_ms:9.1f} {r.wall_ratio:8.1f}"
        cpu = f"{r.floor_cpu_ms:12.1f} {r.spawn_cpu_ms:12.1f} {r.cpu_ratio:8.1f}"
        print(f"{r.n:>4} {r.hosts:>5} | {wall} | {cpu}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--floor", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.floor:
        floor_main(*args.floor)
        return 0
    rows = run(args.sizes, args.reps)
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
