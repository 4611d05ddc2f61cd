"""How soon a SIGKILLed process with a big address space can be seen dead, by each signal.

A replica's death is noticed when its process is reaped (the fork server's SIGCHLD and
`waitpid`); the kernel reports the exit (pidfd readable, sockets closed, zombie) only after it
has torn the process's memory down, which takes longer the more memory it held (issue #16:
detection took 0.46 s at 1 GB with a spare, TorchFT's 0.18 s). A robust process-shared mutex
that the process holds is released by the kernel *before* that teardown (`exit_mm` handles
the robust futex list first), so its waiter wakes with EOWNERDEAD at once. This measures,
per resident size, the time from the SIGKILL to each signal, medians of `--reps`:

    python3 benchmarks/bench_exit_signal.py [--sizes-gb 0.1,1,3] [--reps 3] [--json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

EOWNERDEAD = 130
LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


def robust_mutex(memory: mmap.mmap) -> ctypes.c_void_p:
    """A robust, process-shared pthread mutex at the start of shared `memory`."""
    attr = ctypes.create_string_buffer(64)
    LIBC.pthread_mutexattr_init(attr)
    LIBC.pthread_mutexattr_setpshared(attr, 1)  # PTHREAD_PROCESS_SHARED
    LIBC.pthread_mutexattr_setrobust(attr, 1)  # PTHREAD_MUTEX_ROBUST
    place = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(memory)))
    if LIBC.pthread_mutex_init(place, attr) != 0:
        raise OSError("pthread_mutex_init failed")
    return place


def one_kill(gigabytes: float) -> dict[str, float]:
    """Fork a child that locks the mutex and touches `gigabytes`, SIGKILL it; ms to each
    signal: the mutex's owner death, the pidfd, EOF on a socket only the child holds."""
    memory = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)
    mutex = robust_mutex(memory)
    ready_read, ready_write = os.pipe()
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child: holds the mutex, the socket's other end, and the memory
        LIBC.pthread_mutex_lock(mutex)
        held = bytearray(int(gigabytes * 1e9))
        held[:: mmap.PAGESIZE] = b"\1" * len(held[:: mmap.PAGESIZE])  # every page resident
        os.write(ready_write, b"x")
        while True:
            time.sleep(1)
    theirs.close()
    os.read(ready_read, 1)
    seen: dict[str, float] = {}
    waiter = threading.Thread(target=lambda: seen.update(mutex=_owner_died(mutex)))
    waiter.start()
    time.sleep(0.2)  # the waiter blocks in the mutex
    pidfd = os.pidfd_open(pid)
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    poll.register(ours, select.POLLIN)
    while len(seen) < 3:
        for fd, _ in poll.poll(10):  # ms: the mutex's waiter may come last
            seen["pidfd" if fd == pidfd else "socket"] = time.monotonic()
            poll.unregister(fd)
    waiter.join()
    os.waitpid(pid, 0)
    os.close(pidfd)
    ours.close()
    return {name: (at - started) * 1000 for name, at in seen.items()}


def _owner_died(mutex: ctypes.c_void_p) -> float:
    code = LIBC.pthread_mutex_lock(mutex)
    at = time.monotonic()
    if code != EOWNERDEAD:
        raise RuntimeError(f"the mutex came back with {code}, not EOWNERDEAD")
    return at


# -- through a mesh: kill -> the supervision event at the client -----------------------------


def mesh_kill(gigabytes: float) -> dict[str, float]:
    """A fresh one-proc mesh whose actor touches `gigabytes` and has a call in flight; ms from
    its SIGKILL to that call's SupervisionError (caller) and to the mesh's handler (owner)."""
    from mesh import Actor, endpoint, this_host
    from supervision import SupervisionError

    class Resident(Actor):
        @endpoint
        def hold(self, size: float) -> int:
            self.held = bytearray(int(size * 1e9))
            self.held[:: mmap.PAGESIZE] = b"\1" * len(self.held[:: mmap.PAGESIZE])
            return os.getpid()

        @endpoint
        def sleep(self, seconds: float) -> None:
            time.sleep(seconds)

    seen: dict[str, float] = {}
    procs = this_host().spawn_procs(per_host={"rank": 1}, name="bench-exit")
    procs.on_failure(lambda event: seen.setdefault("owner", time.monotonic()) > 0)
    actor = procs.spawn("resident", Resident)
    pid = actor.hold.call_one(gigabytes).get(timeout=300)
    in_flight = actor.sleep.call_one(600.0)
    time.sleep(0.2)
    started = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    try:
        in_flight.get(timeout=60)
    except SupervisionError:
        seen["caller"] = time.monotonic()
    deadline = time.monotonic() + 10
    while "owner" not in seen and time.monotonic() < deadline:
        time.sleep(0.001)
    procs.stop().get(timeout=60)
    return {name: (at - started) * 1000 for name, at in seen.items()}


def compare(args: argparse.Namespace) -> None:
    """Kill through a mesh with `args.baseline`'s code and this tree's, alternating runs."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"base": os.path.abspath(args.baseline), "new": here}
    print(f"load average {os.getloadavg()[0]:.1f}; ms from SIGKILL to the supervision event")
    print(f"{'GB':>5} {'tree':>5} {'caller':>8} {'owner':>8}   (median of {args.reps}; each run)")
    for size in (float(s) for s in args.sizes_gb.split(",")):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for _ in range(args.reps):
            for name, tree in trees.items():
                command = [
                    sys.executable,
                    __file__,
                    "--mesh",
                    "--json",
                    "--reps",
                    "1",
                    "--sizes-gb",
                ]
                env = dict(os.environ, PYTHONPATH=tree)
                out = subprocess.run(
                    [*command, str(size)],
                    env=env,
                    cwd=tree,
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                runs[name].append(json.loads(out)[0])
        for name, kills in runs.items():
            each = " ".join(f"{k['owner']:.0f}" for k in kills)
            caller = statistics.median(k["caller"] for k in kills)
            owner = statistics.median(k["owner"] for k in kills)
            print(f"{size:>5} {name:>5} {caller:>8.1f} {owner:>8.1f}   {each}")


# -- what watching costs: one futex_waitv thread (DeathWatch) or a thread per proc ------------


def _cpu_s(waiter: int) -> float:
    """CPU seconds of this process and of the death watch's waiter process (all threads)."""
    total_ns = 0
    for task in os.listdir(f"/proc/{waiter}/task"):
        with open(f"/proc/{waiter}/task/{task}/schedstat") as file:
            total_ns += int(file.read().split()[0])
    return time.process_time() + total_ns / 1e9


def watch_cost(count: int, how: str) -> dict[str, float]:
    """Fork `count` idle children holding their mutex, watched `how` ("none"; "waitv": by the
    death watch's waiter process; "threads": a thread each here), then SIGKILL them all: CPU
    ms of this process and the waiter (forks included) to fork and watch, CPU ms and wall ms
    until every death was seen."""
    from mesh._agent.death_watch import DeathWatch

    deaths, seen, pids = DeathWatch(), [], []
    cpu = _cpu_s(deaths.waiter_pid)
    for _ in range(count):
        slot = deaths.arm()
        held, holding = os.pipe()
        pid = os.fork()
        if pid == 0:
            deaths.hold(slot)
            os.write(holding, b"x")
            time.sleep(600)
        os.close(holding)
        os.read(held, 1)
        os.close(held)
        pids.append(pid)
        if how == "waitv":
            deaths.watch(slot, pid)
        elif how == "threads":
            mutex = ctypes.c_void_p(deaths._address(slot))
            thread = threading.Thread(
                target=lambda m=mutex: seen.append(LIBC.pthread_mutex_lock(m))
            )
            thread.start()
    deaths.commit()
    forked = _cpu_s(deaths.waiter_pid)
    time.sleep(0.5)  # every waiter waits
    started, cpu_kill = time.monotonic(), _cpu_s(deaths.waiter_pid)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    while how != "none" and len(seen) < count:
        if how == "waitv":
            select.select([deaths], [], [], 1.0)
            seen += deaths.take()
        else:
            time.sleep(0.0005)
    wall = time.monotonic() - started
    cpu_seen = _cpu_s(deaths.waiter_pid) - cpu_kill
    for pid in pids:
        os.waitpid(pid, 0)
        deaths.reaped(pid, 9)
    deaths.close()
    return {
        "fork_watch_cpu_ms": (forked - cpu) * 1e3,
        "kill_cpu_ms": cpu_seen * 1e3,
        "all_seen_ms": wall * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", default="0.1,1,3")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mesh", action="store_true", help="kill a proc of a mesh instead")
    parser.add_argument("--baseline", help="a checkout to compare --mesh with, run alternately")
    parser.add_argument("--watch-cost", type=int, help="N procs: what watching them costs")
    args = parser.parse_args()
    if args.watch_cost:
        print(
            f"load average {os.getloadavg()[0]:.1f}; {args.watch_cost} procs, median of "
            f"{args.reps}: CPU ms to fork and watch them; CPU ms and ms to see them killed"
        )
        runs: dict[str, list[dict[str, float]]] = {"none": [], "waitv": [], "threads": []}
        for _ in range(args.reps):
            for how, kept in runs.items():
                kept.append(watch_cost(args.watch_cost, how))
        for how, kept in runs.items():
            row = {k: statistics.median(r[k] for r in kept) for k in kept[0]}
            print(f"{how:>8} " + " ".join(f"{k} {v:7.1f}" for k, v in row.items()))
        return
    if args.baseline:
        compare(args)
        return
    rows = []
    for size in (float(s) for s in args.sizes_gb.split(",")):
        if args.mesh:
            mesh_kill(0.01)  # the first failure of a client costs more (imports, the agent's start)
        kills = [(mesh_kill if args.mesh else one_kill)(size) for _ in range(args.reps)]
        row = {"gb": size} | {k: statistics.median(x[k] for x in kills) for k in kills[0]}
        rows.append(row)
    if args.json:
        print(json.dumps(rows))
        return
    if args.mesh:
        print(f"load average {os.getloadavg()[0]:.1f}; ms from SIGKILL, median of {args.reps}")
        print(f"{'GB':>5} {'caller':>8} {'owner':>8}")
        for row in rows:
            print(f"{row['gb']:>5} {row['caller']:>8.1f} {row['owner']:>8.1f}")
        return
    print(f"load average {os.getloadavg()[0]:.1f}; ms from SIGKILL, median of {args.reps}")
    print(f"{'GB':>5} {'robust mutex':>13} {'pidfd':>8} {'socket':>8}")
    for row in rows:
        print(f"{row['gb']:>5} {row['mutex']:>13.1f} {row['pidfd']:>8.1f} {row['socket']:>8.1f}")


if __name__ == "__main__":
    main()
