"""A tour of meshvisor in one script: spawn 4 procs, call them every way, break one.

Run it with ``python3 examples/tour.py`` (a few seconds on 2 cores). Set
``MESHVISOR_LOG_LEVEL=info`` to watch the structured lifecycle logs as well.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

os.environ.setdefault("MESHVISOR_LOG_LEVEL", "error")  # keep the demo's own output readable

import anyio

from mesh import Actor, current_rank, current_size, endpoint, this_host
from supervision import ActorError, SupervisionError


class Worker(Actor):
    """A small actor: one instance per proc, with some state of its own."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.rank = current_rank().rank  # this actor's place in the mesh it was spawned in
        self.count = 0

    @endpoint
    def whoami(self) -> dict[str, object]:
        return {"point": dict(current_rank()), "sizes": current_size(), "pid": os.getpid()}

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def work(self, x: float) -> float:
        return x * self.scale + self.rank

    @endpoint
    def bump(self, n: int) -> None:  # used with broadcast(): nobody waits for a reply
        self.count += n

    @endpoint
    def total(self) -> int:
        return self.count

    @endpoint
    async def slow_square(self, x: int) -> tuple[int, int]:  # endpoints may be async
        await anyio.sleep(0.02 * (4 - self.rank))  # higher ranks answer first
        return self.rank, x * x

    @endpoint
    def check(self, x: float) -> float:
        if x < 0:
            raise ValueError(f"x must be >= 0, got {x}")
        return x**0.5

    @endpoint
    def nap(self, seconds: float) -> str:
        time.sleep(seconds)
        return "rested"


def section(title: str) -> None:
    print(f"\n== {title}")


def main() -> None:
    started = time.monotonic()

    section("spawn: 4 procs on this host, one Worker actor on each")
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    workers = procs.spawn("workers", Worker, scale=10.0)  # returns at once
    print(f"  {procs}  ->  {workers}")
    for point, info in workers.whoami.call().get():
        print(f"  {point}: pid {info['pid']}, sizes {info['sizes']}")

    section("adverbs")
    results = workers.work.call(1.5).get()  # every actor; a ValueMesh of (Point, value)
    print(f"  call(1.5)          -> {results.values()}")
    print(f"  item(gpus=3)       -> {results.item(gpus=3)}")
    one = workers.slice(gpus=0).work.call_one(2.0).get()  # exactly one actor
    print(f"  call_one(2.0)      -> {one}   (on the slice gpus=0)")
    print(f"  choose(2.0)        -> {workers.work.choose(2.0).get()}   (a random actor)")
    arrived = [f.get() for f in workers.slow_square.stream(7)]  # in arrival order
    print(f"  stream(7)          -> {arrived}   ((rank, value) in arrival order)")
    workers.bump.broadcast(5)  # fire and forget; per-sender FIFO orders it before the next call
    print(f"  broadcast(5), then total.call() -> {workers.total.call().get().values()}")

    async def concurrently() -> list[float]:
        futures = [workers.slice(gpus=g).work.call_one(g) for g in range(4)]
        return [await f for f in futures]

    print(f"  await in asyncio   -> {asyncio.run(concurrently())}")

    section("slicing")
    pairs = workers.slice(gpus=slice(0, 2))
    print(f"  slice(gpus=slice(0, 2)): sizes={pairs.sizes} len={len(pairs)}")
    print(f"    whoami points -> {[v['point'] for v in pairs.whoami.call().get().values()]}")
    grid = procs.spawn("grid", Worker, scale=1.0).flatten("x").slice(x=slice(None, None, 2))
    renamed = grid.rename(x="replica")
    print(
        f"  flatten/slice/rename: extent={renamed.extent} size('replica')={renamed.size('replica')}"
    )
    print(f"    whoami points -> {[v['point'] for v in renamed.whoami.call().get().values()]}")
    renamed.stop().get()

    section("an endpoint raises: the caller gets the exception, the actor survives")
    try:
        workers.slice(gpus=1).check.call_one(-4.0).get()
    except ValueError as err:  # an ActorError is also an instance of the original type
        print(
            f"  caught {type(err).__name__}; isinstance ActorError: "
            f"{isinstance(err, ActorError)}, ValueError: {isinstance(err, ValueError)}"
        )
        print(f"  message: {err}")
        remote = err.remote_traceback.strip().splitlines() if isinstance(err, ActorError) else []
        print("  remote traceback (last lines):")
        for line in remote[-3:]:
            print(f"    | {line}")
    print(
        f"  the same actor still answers: check(16.0) -> "
        f"{workers.slice(gpus=1).check.call_one(16.0).get()}"
    )

    section("SIGKILL one proc: a SupervisionError at once, the other ranks keep working")
    victim = workers.slice(gpus=2)
    pid = victim.pid.call_one().get()
    t0 = time.monotonic()
    try:
        napping = victim.nap.call_one(30.0)  # would take 30 s; the crash ends it early
        os.kill(pid, signal.SIGKILL)
        napping.get(timeout=10)
    except SupervisionError as err:
        waited = (time.monotonic() - t0) * 1000
        print(f"  killed pid {pid}; nap() failed after {waited:.0f} ms with SupervisionError:")
        print(f"    {err}")
        print(
            f"    event: kind={err.event.kind!r} signal={err.event.signal!r} "
            f"rank={dict(err.event.rank or {})}"
        )
    for g in (0, 1, 3):
        print(
            f"  gpus={g} still works: work(1.0) -> {workers.slice(gpus=g).work.call_one(1.0).get()}"
        )
    try:
        workers.work.call(1.0).get()
    except SupervisionError as err:
        print(f"  a call to the whole mesh names the dead rank: {dict(err.event.rank or {})}")

    section("stop")
    workers.stop().get()
    try:
        workers.slice(gpus=0).work.call_one(1.0).get()
    except SupervisionError as err:
        print(f"  after stop(): SupervisionError: {err}")
    procs.stop().get()
    print(f"  done in {time.monotonic() - started:.2f} s")


if __name__ == "__main__":
    main()
