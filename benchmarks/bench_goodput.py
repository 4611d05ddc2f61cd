"""Goodput under failures: meshvisor's ReplicaGroup against TorchFT 0.2.0, on the same model,
data and machine, in the same run; and the step time of both against plain torch.distributed.

For each model size (the demo's MLP, ~100 MB and ~1 GB of state: parameters plus Adam's two
moments), 3 replicas train on this machine, one system after the other (memory):

- meshvisor: `recovery.ReplicaGroup` on `this_host()`, heartbeat 1 s;
- TorchFT: one process per replica (its `Manager`, torchft's gloo process group, a TCPStore),
  a `LighthouseServer` in this process (heartbeat timeout 1 s, join timeout 2 s, tick 20 ms),
  and a supervisor loop written here that re-spawns a dead replica process at once (forked from
  a warm fork server that has torch and torchft imported: no import time, as meshvisor's);
  torchft heals the replacement from a live peer when it joins a quorum.

Each system trains without faults for half the baseline time, then, for each period T, with
a SIGKILL of a random replica every T seconds (at a random point of a step: a thread kills on
a timer; the next kill waits for the last replacement to commit), then without faults for the
other half. The run with kills lasts `kills` * T, one kill in each period; the baseline lasts
as long in all (`--fault-free-s`), so that a load that drifts weighs on both alike. The
baseline is the fault-free steps over the fault-free time (time-weighted), and the spread of
both is printed: the steps/s of each T-long window. Goodput is committed steps per second with
kills over the baseline. Recovery is the time from the SIGKILL to the replacement's first
committed step. A third run per size is a plain loop without fault tolerance: torch.distributed gloo
allreduce of each gradient, then Adam, on 3 processes: the floor for the step time.

    python3 benchmarks/bench_goodput.py [--sizes demo,100MB,1GB] [--periods 10,30] [--kills 3]
    python3 benchmarks/bench_goodput.py --quick          # demo and 100MB, T = 5 s, 3 kills
    python3 benchmarks/bench_goodput.py --sizes 1GB --periods 30 --spares 1   # ~12 min
    python3 benchmarks/bench_goodput.py --spares 1       # also ReplicaGroup(spares=1)

Every system runs with the malloc settings a replica gets by default (`recovery.TENSOR_MALLOC`:
big tensors kept in one heap); `--malloc default` runs every system with glibc's defaults.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import logging
import multiprocessing
import os
import random
import signal
import statistics
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("MESHVISOR_LOG_LEVEL", "error")
os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side: not a line per quorum

import torch

REPLICAS = 3
HEARTBEAT_S = 1.0
GOAL_GOODPUT = 0.9
GOAL_SPEEDUP = 5.0
#: The longest wait for replicas to come up or recover before the run is called failed.
WAIT_S = 300.0


# -- the model and data, the same for every system -------------------------------------------


@dataclass(frozen=True)
class Size:
    """A model: `layers` Linear(width, width) (the demo's MLP when width is 0), a batch of
    `rows` rows; its state is parameters + Adam's two moments."""

    name: str
    width: int
    layers: int
    rows: int
    step_timeout_s: float  # for a step on a busy 2-core machine, both systems

    @property
    def params(self) -> int:
        if not self.width:
            return 32 * 64 + 64 + 64 + 1
        return self.layers * (self.width * self.width + self.width)

    @property
    def state_mb(self) -> float:
        return self.params * 12 / 1e6


SIZES = {
    "demo": Size("demo", 0, 0, 64, 10.0),
    "100MB": Size("100MB", 1024, 8, 16, 30.0),
    "1GB": Size("1GB", 4096, 5, 8, 120.0),
}


def build_model(size: Size) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # every replica starts from the same weights
    if not size.width:  # meshvisor/_demo.py's model
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        )
        return model, torch.optim.Adam(model.parameters(), lr=3e-3)
    layers: list[torch.nn.Module] = []
    for _ in range(size.layers):
        layers += [torch.nn.Linear(size.width, size.width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def batch_loss(model: torch.nn.Module, size: Size, step: int, shard: int) -> torch.Tensor:
    """The loss of `shard`'s synthetic batch at `step` (deterministic)."""
    generator = torch.Generator().manual_seed(step * 100_003 + shard)
    inputs = torch.randn(size.rows, size.width or 32, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin() if not size.width else inputs.sin()
    return torch.nn.functional.mse_loss(model(inputs), targets)


# -- what each system's run yields ------------------------------------------------------------


@dataclass
class KillRun:
    period_s: float
    steps_per_s: float
    kills: int
    recovery_s: list[float]
    windows: list[float] = field(default_factory=list)  # steps/s of each period (one kill each)
    phases: dict[str, list[float]] = field(default_factory=dict)  # where the recovery time goes
    other_failures: int = 0  # restarts not caused by a kill (torchft errors)
    unrecovered: int = 0  # kills whose replacement did not commit within WAIT_S


@dataclass
class SystemRun:
    system: str
    size: str
    steps_per_s: float = 0.0  # without faults: all fault-free windows, time-weighted
    with_kills: list[KillRun] = field(default_factory=list)
    windows: list[float] = field(default_factory=list)  # steps/s of each fault-free window
    counted: list[tuple[int, float]] = field(default_factory=list)  # (steps, s) per window

    def fault_free(self, counted: list[tuple[int, float]]) -> None:
        """Add fault-free windows (steps, seconds): the baseline is their time-weighted rate."""
        self.counted += counted
        self.windows += [steps / seconds for steps, seconds in counted]
        self.steps_per_s = sum(n for n, _ in self.counted) / sum(s for _, s in self.counted)


def count_windows(
    advance: Any, steps: Any, seconds: float, window_s: float
) -> list[tuple[int, float]]:
    """Call `advance()` for `seconds`; the (steps, seconds) of each `window_s` window, as read
    from `steps()` at the first call that ends past each window's end."""
    counted: list[tuple[int, float]] = []
    started = time.monotonic()
    begin, mark = steps(), started
    while (now := time.monotonic()) < started + seconds:
        if now >= mark + window_s:
            counted.append((steps() - begin, now - mark))
            begin, mark = steps(), now
        advance()
    if counted and now - mark < window_s / 2:  # a short tail joins the window before it
        last_steps, last_s = counted.pop()
        counted.append((last_steps + steps() - begin, last_s + now - mark))
    elif now > mark:
        counted.append((steps() - begin, now - mark))
    return counted


def fault_free_halves(args: argparse.Namespace) -> tuple[float, float]:
    """The fault-free time before and after the runs with kills: as long in all as the
    longest run with kills, unless --fault-free-s says otherwise; half before, half after,
    so that a load that drifts during the run weighs on the baseline as on the kills."""
    total = args.fault_free_s or args.kills * max(args.periods)
    return total / 2, total / 2


class Killer(threading.Thread):
    """SIGKILLs a random replica at start + (k + 1/2) * period, k = 0..kills-1, each time as
    soon as every replica is ready (`pids` holds one pid per ready replica)."""

    def __init__(self, period_s: float, kills: int, seed: int) -> None:
        super().__init__(daemon=True, name="killer")
        self.period_s, self.count = period_s, kills
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.pids: dict[int, int] = {}  # replica -> pid, of the replicas that may be killed
        self.replicas = REPLICAS
        self.kills: list[tuple[int, float]] = []  # (replica, time.monotonic() of the kill)
        self.stopped = threading.Event()
        self.started_at = time.monotonic()

    def start(self) -> None:
        self.started_at = time.monotonic()
        super().start()

    def run(self) -> None:
        for k in range(self.count):
            due = self.started_at + (k + 0.5) * self.period_s
            while not self.stopped.wait(max(0.0, min(0.01, due - time.monotonic()))):
                with self.lock:
                    if time.monotonic() >= due and len(self.pids) == self.replicas:
                        victim = self.rng.randrange(self.replicas)
                        at = time.monotonic()  # before: its death may be seen before we go on
                        try:
                            os.kill(self.pids.pop(victim), signal.SIGKILL)
                        except ProcessLookupError:  # it died by itself: wait for its successor
                            continue
                        self.kills.append((victim, at))
                        break
            if self.stopped.is_set():
                return

    def ready(self, replica: int, pid: int) -> None:
        with self.lock:
            self.pids[replica] = pid

    def forget(self, replica: int) -> None:
        """`replica` died by itself: no kill until its successor is ready."""
        with self.lock:
            self.pids.pop(replica, None)


def window_of(args: argparse.Namespace) -> float:
    """Fault-free windows as long as the shortest period: their spread is comparable with
    that of the periods of a run with kills (one kill each)."""
    return min(args.periods)


def until(killer: Killer) -> float:
    return killer.started_at + killer.count * killer.period_s


# -- meshvisor ---------------------------------------------------------------------------------


def meshvisor_run(size: Size, args: argparse.Namespace, spares: int = 0) -> SystemRun:
    from mesh import endpoint, this_host
    from recovery import Replica, ReplicaGroup

    class GoodputReplica(Replica):
        def __init__(self, size: Size) -> None:
            self.size = size
            super().__init__()

        def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            return build_model(self.size)

        def loss(self, model: torch.nn.Module, step: int, shard: int) -> torch.Tensor:
            return batch_loss(model, self.size, step, shard)

        @endpoint
        def pid(self) -> int:
            return os.getpid()

    group = ReplicaGroup(
        this_host(),
        GoodputReplica,
        size,
        replicas=REPLICAS,
        name=f"goodput-{size.name}",
        heartbeat_timeout_s=HEARTBEAT_S,
        step_timeout_s=size.step_timeout_s,
        spares=spares,
    )
    try:
        for _ in range(3):  # warm up: Adam's moments exist, the group is formed
            group.step()
        result = SystemRun(f"meshvisor+{spares}" if spares else "meshvisor", size.name)
        before, after = fault_free_halves(args)
        group.wait_for_all(timeout=WAIT_S)
        result.fault_free(_meshvisor_windows(group, before, args))
        for period in args.periods:
            result.with_kills.append(_meshvisor_kills(group, period, args))
        group.wait_for_all(timeout=WAIT_S)
        result.fault_free(_meshvisor_windows(group, after, args))
        problem = group.check_consistency()
        if problem:
            raise RuntimeError(f"meshvisor's replicas ended inconsistent: {problem}")
    finally:
        group.close()
    return result


def _meshvisor_windows(
    group: Any, seconds: float, args: argparse.Namespace
) -> list[tuple[int, float]]:
    return count_windows(group.step, lambda: group.committed_steps, seconds, window_of(args))


def _meshvisor_kills(group: Any, period: float, args: argparse.Namespace) -> KillRun:
    group.wait_for_all(timeout=WAIT_S)
    killer = Killer(period, args.kills, args.seed)
    for index, mesh in enumerate(group.replicas):
        killer.ready(index, mesh.pid.call_one().get(timeout=30))
    recoveries_before = len(group.recoveries)
    begin = group.committed_steps
    killer.start()
    seen: set[int] = set()

    def recovering() -> bool:
        """Take note of the replacements that committed; whether one has yet to."""
        for position, recovery in enumerate(group.recoveries[recoveries_before:]):
            if recovery.first_commit_at is not None and position not in seen:
                seen.add(position)
                mesh = group.replicas[recovery.replica]
                killer.ready(recovery.replica, mesh.pid.call_one().get(timeout=30))
        return len(group.recoveries) - recoveries_before > len(seen)

    def advance() -> None:
        group.step()
        recovering()

    windows = count_windows(
        advance, lambda: group.committed_steps, until(killer) - time.monotonic(), period
    )
    killer.stopped.set()
    killer.join()
    while recovering():  # the last kill's replacement commits: its time counts
        group.step()
    elapsed = time.monotonic() - killer.started_at
    run = KillRun(period, (group.committed_steps - begin) / elapsed, len(killer.kills), [])
    run.windows = [steps / seconds for steps, seconds in windows]
    names = ("detect", "spawn", "heal", "first step")
    run.phases = {name: [] for name in names}
    recoveries = group.recoveries[recoveries_before:]
    for victim, killed_at in killer.kills:
        # the first failure of the victim noticed after the kill
        found = [r for r in recoveries if r.replica == victim and r.failed_at >= killed_at]
        recovery = found[0] if found else None
        if recovery is None or recovery.first_commit_at is None:
            print(f"  meshvisor: the kill of replica {victim} has no recovery ({recovery})")
            run.unrecovered += 1
            continue
        run.recovery_s.append(recovery.first_commit_at - killed_at)
        marks = [killed_at, recovery.failed_at, recovery.respawned_at, recovery.healed_at]
        marks.append(recovery.first_commit_at)
        for name, (a, b) in zip(names, itertools.pairwise(marks), strict=True):
            if a is not None and b is not None:
                run.phases[name].append(b - a)
    run.other_failures = len(recoveries) - len(killer.kills)
    return run


# -- TorchFT ------------------------------------------------------------------------------------


def quiet_torchft() -> None:
    """torchft logs each swallowed collective error with a traceback (a kill makes several)."""
    for name in ("torchft", "torchft_errors", "torchft_quorums", "torchft_commits"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def torchft_replica(index: int, size: Size, lighthouse: str, out: Connection) -> None:
    """A TorchFT replica process: its own loop of steps until killed. It reports
    ("up", pid, time) once built, then (step, committed, time) after each step."""
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    quiet_torchft()
    torch.set_num_threads(1)
    model, optimizer = build_model(size)
    timeout = datetime.timedelta(seconds=size.step_timeout_s)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=REPLICAS - 1,
        replica_id=f"replica_{index}",
        lighthouse_addr=lighthouse,
        hostname="localhost",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=timeout,
        quorum_timeout=timeout * 2,
        connect_timeout=timeout,
        init_sync=False,
    )
    out.send(("up", os.getpid(), time.monotonic()))
    while True:
        manager.start_quorum()
        optimizer.zero_grad()
        batch_loss(model, size, manager.current_step(), index).backward()  # type: ignore[no-untyped-call]
        for work in [manager.allreduce(p.grad) for p in model.parameters()]:
            work.wait()
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        out.send((manager.current_step(), committed, time.monotonic()))


@dataclass
class _Proc:
    process: Any
    conn: Connection
    started_at: float
    up_at: float | None = None
    pid: int = 0
    killed_at: float | None = None  # our SIGKILL (None: not one of ours)
    died_at: float | None = None


class TorchFTSupervisor:
    """Runs the replica processes of one model size; re-spawns one as soon as it dies."""

    def __init__(self, size: Size, context: Any, lighthouse: str) -> None:
        self.size, self.context, self.lighthouse = size, context, lighthouse
        self.procs: dict[int, _Proc] = {}
        self.step = 0  # the furthest committed step any replica reported
        self.killer: Killer | None = None
        self.recoveries: list[tuple[float, dict[str, float]]] = []  # (kill to commit, phases)
        self.other_failures = 0
        for index in range(REPLICAS):
            self._start(index)

    def _start(self, index: int) -> None:
        ours, theirs = self.context.Pipe(duplex=False)
        process = self.context.Process(
            target=torchft_replica, args=(index, self.size, self.lighthouse, theirs), daemon=True
        )
        process.start()
        theirs.close()
        self.procs[index] = _Proc(process, ours, time.monotonic())

    def pump(self, seconds: float) -> None:
        """Take in reports and deaths for `seconds`; re-spawn whatever died."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            by_conn = {p.conn: i for i, p in self.procs.items()}
            for conn in wait(list(by_conn), timeout=min(left, 0.05)):
                index = by_conn[conn]  # type: ignore[index]
                try:
                    while conn.poll():  # type: ignore[union-attr]
                        self._report(index, conn.recv())  # type: ignore[union-attr]
                except (EOFError, OSError):
                    self._died(index)

    def _report(self, index: int, message: tuple[Any, ...]) -> None:
        proc = self.procs[index]
        if message[0] == "up":
            proc.pid, proc.up_at = message[1], message[2]
            return
        step, committed, at = message
        if not committed:
            return
        self.step = max(self.step, step)
        if self.killer is not None and proc.pid and not self._is_ready(index):
            if proc.killed_at is not None:  # a replacement's first commit after our kill
                self.recoveries.append((at - proc.killed_at, self._phases(proc, at)))
            self.killer.ready(index, proc.pid)

    def _is_ready(self, index: int) -> bool:
        assert self.killer is not None
        with self.killer.lock:
            return self.killer.pids.get(index) == self.procs[index].pid

    def _phases(self, proc: _Proc, at: float) -> dict[str, float]:
        assert proc.killed_at is not None and proc.up_at is not None
        return {
            "detect": proc.died_at - proc.killed_at if proc.died_at else 0.0,
            "spawn": proc.up_at - proc.started_at,
            "heal + first step": at - proc.up_at,
        }

    def _died(self, index: int) -> None:
        old = self.procs[index]
        old.process.join(timeout=30)
        died_at = time.monotonic()
        killed_at = None
        if self.killer is not None:
            killed_at = next((t for i, t in reversed(self.killer.kills) if i == index), None)
            if killed_at is not None and killed_at < old.started_at:
                killed_at = None
        if killed_at is None:
            self.other_failures += 1
            if self.killer is not None:
                self.killer.forget(index)
            print(f"  torchft replica {index} exited by itself ({old.process.exitcode})")
        old.conn.close()
        self._start(index)
        self.procs[index].killed_at, self.procs[index].died_at = killed_at, died_at

    def close(self) -> None:
        for proc in self.procs.values():
            proc.process.kill()
        for proc in self.procs.values():
            proc.process.join(timeout=30)
            proc.conn.close()


def torchft_run(size: Size, args: argparse.Namespace) -> SystemRun:
    from torchft.coordination import LighthouseServer

    quiet_torchft()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torchft"])
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=REPLICAS - 1,
        join_timeout_ms=2000,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=int(HEARTBEAT_S * 1000),
    )
    supervisor = TorchFTSupervisor(size, context, lighthouse.address())
    try:
        if not _pump_until(supervisor, lambda: supervisor.step >= 3, WAIT_S):
            raise TimeoutError(f"torchft committed no 3 steps within {WAIT_S:g} s")
        result = SystemRun("torchft", size.name)
        before, after = fault_free_halves(args)
        result.fault_free(_torchft_windows(supervisor, before, args))
        for period in args.periods:
            result.with_kills.append(_torchft_kills(supervisor, period, args))
        result.fault_free(_torchft_windows(supervisor, after, args))
    finally:
        supervisor.close()
        lighthouse.shutdown()
    return result


def _torchft_windows(
    supervisor: TorchFTSupervisor, seconds: float, args: argparse.Namespace
) -> list[tuple[int, float]]:
    return count_windows(
        lambda: supervisor.pump(0.05), lambda: supervisor.step, seconds, window_of(args)
    )


def _torchft_kills(
    supervisor: TorchFTSupervisor, period: float, args: argparse.Namespace
) -> KillRun:
    killer = Killer(period, args.kills, args.seed)
    supervisor.killer, supervisor.recoveries, supervisor.other_failures = killer, [], 0
    for index, proc in supervisor.procs.items():
        if proc.up_at is not None:
            killer.ready(index, proc.pid)  # else at its first commit
    begin = supervisor.step
    killer.start()
    windows = count_windows(
        lambda: supervisor.pump(0.05),
        lambda: supervisor.step,
        until(killer) - time.monotonic(),
        period,
    )
    killer.stopped.set()
    killer.join()
    _pump_until(supervisor, lambda: len(supervisor.recoveries) >= len(killer.kills), WAIT_S)
    elapsed = time.monotonic() - killer.started_at
    supervisor.killer = None
    run = KillRun(period, (supervisor.step - begin) / elapsed, len(killer.kills), [])
    run.windows = [steps / seconds for steps, seconds in windows]
    run.recovery_s = [seconds for seconds, _ in supervisor.recoveries]
    run.phases = {
        name: [phases[name] for _, phases in supervisor.recoveries]
        for name in ("detect", "spawn", "heal + first step")
    }
    run.other_failures = supervisor.other_failures
    run.unrecovered = len(killer.kills) - len(supervisor.recoveries)
    return run


def _pump_until(supervisor: TorchFTSupervisor, done: Any, limit_s: float) -> bool:
    """Pump until `done()`, for at most `limit_s`; whether it is done."""
    deadline = time.monotonic() + limit_s
    while not done():
        if time.monotonic() > deadline:
            return False
        supervisor.pump(0.05)
    return True


# -- the floor: plain torch.distributed, no fault tolerance -------------------------------------


def plain_rank(rank: int, size: Size, port: int, steps: int, out: Connection) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=size.step_timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
    group = dist.ProcessGroupGloo(store, rank, REPLICAS, timeout)  # type: ignore[attr-defined]
    model, optimizer = build_model(size)
    started = 0.0
    for step in range(1, steps + 4):
        if step == 4:  # after 3 warm-up steps
            group.barrier().wait()
            started = time.perf_counter()
        optimizer.zero_grad()
        batch_loss(model, size, step, rank).backward()  # type: ignore[no-untyped-call]
        for param in model.parameters():
            assert param.grad is not None
            group.allreduce([param.grad]).wait()
            param.grad /= REPLICAS
        optimizer.step()
    group.barrier().wait()
    out.send((time.perf_counter() - started) / steps)


def plain_step_s(size: Size, steps: int) -> float:
    """Seconds per step of the plain loop (the slowest rank's mean over `steps`)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    context = multiprocessing.get_context("forkserver")
    pipes = [context.Pipe(duplex=False) for _ in range(REPLICAS)]
    procs = [
        context.Process(target=plain_rank, args=(r, size, store.port, steps, pipes[r][1]))
        for r in range(REPLICAS)
    ]
    for proc in procs:
        proc.start()
    try:
        times = []
        for ours, _ in pipes:
            if not ours.poll(size.step_timeout_s * (steps + 4)):
                raise TimeoutError("a rank of the plain allreduce loop gave no result")
            times.append(ours.recv())
        return max(times)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()


# -- the tables ---------------------------------------------------------------------------------


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _spread(rates: list[float]) -> str:
    return f"{min(rates):.3g}-{max(rates):.3g}" if rates else "-"


def beyond_a_step(recovery_s: float, run: SystemRun) -> float:
    """What a kill cost beyond the fault-free step that was due anyway: its recovery (kill to
    the replacement's first commit, which includes a step) less one fault-free step, at least
    0 (a recovery shorter than a step lost no time)."""
    return max(recovery_s - 1 / run.steps_per_s, 0.0) if run.steps_per_s else float("nan")


def print_goodput(runs: list[SystemRun]) -> None:
    print("\nGoodput: 3 replicas, a SIGKILL of a random replica every T s")
    for run in runs:
        counted = sum(seconds for _, seconds in run.counted)
        print(
            f"  {run.size} {run.system}: fault-free {run.steps_per_s:.3g} steps/s over "
            f"{counted:.0f} s, windows {_spread(run.windows)}; with kills, periods: "
            + "; ".join(f"T={k.period_s:g} {_spread(k.windows)}" for k in run.with_kills)
        )
    header = ("size", "T s", "system", "kills", "steps/s", "w/ kills", "goodput", "recovery s")
    extra_header = ("x faster", "beyond a step s", "x faster")
    print(
        "{:<6} {:>4} {:<11} {:>5} {:>8} {:>8} {:>7} {:>10}  {:>8} {:>15} {:>8}".format(
            *header, *extra_header
        )
    )
    by_key = {(r.size, r.system): r for r in runs}
    for run in runs:
        other = by_key.get((run.size, "torchft"))
        for kills in run.with_kills:
            recovery = _mean(kills.recovery_s)
            beyond = beyond_a_step(recovery, run)
            speedup = beyond_speedup = ""
            if run.system != "torchft" and other is not None:
                theirs = next(k for k in other.with_kills if k.period_s == kills.period_s)
                speedup = f"{_mean(theirs.recovery_s) / recovery:.1f}"
                theirs_beyond = beyond_a_step(_mean(theirs.recovery_s), other)
                beyond_speedup = f"{theirs_beyond / max(beyond, 1e-3):.1f}"
            extra = f" (+{kills.other_failures} other)" if kills.other_failures else ""
            if kills.unrecovered:
                extra += f" ({kills.unrecovered} not recovered within {WAIT_S:g} s)"
            print(
                f"{run.size:<6} {kills.period_s:>4g} {run.system:<11} {kills.kills:>5} "
                f"{run.steps_per_s:>8.3g} {kills.steps_per_s:>8.3g} "
                f"{kills.steps_per_s / run.steps_per_s:>7.2f} {recovery:>10.2f}  {speedup:>8} "
                f"{beyond:>15.2f} {beyond_speedup:>8}{extra}"
            )
    print(
        f"goals: goodput >= {GOAL_GOODPUT} at one kill / 30 s with 1GB; recovery >= "
        f"{GOAL_SPEEDUP:g}x TorchFT's at every size ('recovery s': kill to the replacement's "
        "first commit; 'beyond a step': less one fault-free step of the same system, floored "
        "at 0 and compared at 1 ms at least)"
    )


def print_phases(runs: list[SystemRun]) -> None:
    print("\nWhere the recovery time goes (mean s per kill)")
    for run in runs:
        for kills in run.with_kills:
            parts = ", ".join(f"{k} {_mean(v):.2f}" for k, v in kills.phases.items())
            print(f"  {run.size:<6} T={kills.period_s:g} {run.system:<11} {parts}")


def print_overhead(runs: list[SystemRun], plain: dict[str, float]) -> None:
    print("\nStep time without faults vs plain torch.distributed allreduce (gloo, no FT)")
    print(
        "{:<6} {:>10} {:>14} {:>8} {:>12} {:>8}".format(
            "size", "plain ms", "meshvisor ms", "x plain", "torchft ms", "x plain"
        )
    )
    by_key = {(r.size, r.system): r for r in runs}
    for name, seconds in plain.items():
        cells = [f"{name:<6} {seconds * 1e3:>10.1f}"]
        for system, width in (("meshvisor", 14), ("torchft", 12)):
            run = by_key.get((name, system))
            step = 1 / run.steps_per_s if run and run.steps_per_s else float("nan")
            cells.append(f"{step * 1e3:>{width}.1f} {step / seconds:>8.2f}")
        print(" ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="demo,100MB,1GB", help=f"of {','.join(SIZES)}")
    parser.add_argument("--periods", default="10,30", help="seconds between kills, per run")
    parser.add_argument("--kills", type=int, default=3, help="kills per period's run")
    parser.add_argument(
        "--fault-free-s",
        type=float,
        default=0.0,
        help="fault-free seconds, half before and half after the kills (0: kills x T)",
    )
    parser.add_argument("--systems", default="meshvisor,spares,torchft,plain")
    parser.add_argument("--plain-steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--spares", type=int, default=0, help="also ReplicaGroup(spares=K), as 'meshvisor+K'"
    )
    parser.add_argument(
        "--malloc",
        choices=("tensor", "default"),
        default="tensor",
        help="every system's malloc: recovery.TENSOR_MALLOC (a replica's default) or glibc's",
    )
    parser.add_argument("--quick", action="store_true", help="demo and 100MB, T = 5 s, 10 s")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.periods, args.fault_free_s, args.plain_steps = "demo,100MB", "5", 5.0, 5
    args.periods = [float(p) for p in args.periods.split(",")]
    systems = args.systems.split(",")
    # the same for all: TorchFT's and the plain loop's processes inherit it, and a replica's
    # procs keep the client's own (an empty one: glibc's defaults)
    from recovery import TENSOR_MALLOC

    os.environ["GLIBC_TUNABLES"] = TENSOR_MALLOC if args.malloc == "tensor" else ""
    print(f"malloc: {args.malloc} ({os.environ['GLIBC_TUNABLES'] or 'glibc defaults'})")
    runs: list[SystemRun] = []
    plain: dict[str, float] = {}
    for name in args.sizes.split(","):
        size = SIZES[name]
        print(f"{name}: {size.params / 1e6:.2f} M parameters, {size.state_mb:.1f} MB of state")
        spares = functools.partial(meshvisor_run, spares=args.spares)
        for system, run in (
            ("meshvisor", meshvisor_run),
            ("spares", spares),
            ("torchft", torchft_run),
        ):
            if system in systems and (system != "spares" or args.spares):
                try:  # one system's failure leaves the other's numbers
                    runs.append(run(size, args))
                    print(f"  {system}: {runs[-1]}", flush=True)
                except Exception as exc:
                    print(f"  {system} {name}: FAILED: {exc!r}", flush=True)
        if "plain" in systems:
            try:
                plain[name] = plain_step_s(size, args.plain_steps)
            except Exception as exc:
                print(f"  plain {name}: FAILED: {exc!r}", flush=True)
    if args.json:
        print(json.dumps({"runs": [asdict(r) for r in runs], "plain_step_s": plain}, indent=2))
        return 0
    print_goodput(runs)
    print_phases(runs)
    print_overhead(runs, plain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
