"""The gradient exchange of `recovery.ReplicaGroup`: time per exchange of one flat gradient,
for the fixed-order reduce-scatter + all-gather (recovery/_exchange.py), the all-gather of
whole gradients it replaced, and plain ``torch.distributed`` allreduce (gloo, whose summing
order is its own) as the floor, in the same run, for 2, 3 and 4 ranks and a few sizes.

Each rank is a process started here, in a gloo group on loopback; every exchange is timed on
every rank and the slowest rank counts (a step waits for it); the median of `--repeats`
exchanges is reported. The ratio column is the time against the allreduce of the same row.
"Sent per rank" is what each rank sends: 2(N-1)/N of the gradient for the new exchange and
allreduce's ring, (N-1) gradients for the all-gather (which the new exchange uses too for
gradients small enough that latency counts more than bytes).

    python3 benchmarks/bench_exchange.py [--sizes 10000,1000000,4000000] [--repeats 9] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from recovery import exchange_average
from recovery import fixed_order_average as average
from recovery._exchange import ALLGATHER_BELOW_BYTES
from recovery.testing import StoreClient, StoreServer

METHODS = ("reduce-scatter+all-gather", "all-gather (old)", "allreduce (floor)")


#: The last result of each size, which the next exchange writes into, as a replica's does.
_RESULTS: dict[int, torch.Tensor] = {}


def new_exchange(group: Any, grad: torch.Tensor) -> torch.Tensor:
    result = exchange_average(group, grad, lambda: None, _RESULTS.get(grad.numel()))
    _RESULTS[grad.numel()] = result
    return result


def old_allgather(group: Any, grad: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(grad) for _ in range(group.size())]
    group.allgather([out], [grad]).wait()
    return average(out)


def allreduce(group: Any, grad: torch.Tensor) -> torch.Tensor:
    total = grad.clone()
    group.allreduce([total]).wait()
    total /= group.size()
    return total


def rank_main(rank: int, world: int, address: Any, plan: dict[str, Any], out: Any) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    store = StoreClient(address, 120.0)
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"w{world}", store), rank, world, timeout)  # type: ignore[attr-defined]
    functions = (new_exchange, old_allgather, allreduce)
    times: dict[str, dict[int, list[float]]] = {m: {} for m in METHODS}
    for numel in plan["sizes"]:
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        for method, function in zip(METHODS, functions, strict=True):
            function(group, grad)  # warm up
            samples = []
            for _ in range(plan["repeats"]):
                group.barrier().wait()
                started = time.perf_counter()
                function(group, grad)
                samples.append(time.perf_counter() - started)
            times[method][numel] = samples
    out.put((rank, times))


def measure(world: int, plan: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Per method and size, the median over repeats of the slowest rank's time."""
    store = StoreServer()
    context = multiprocessing.get_context("spawn")  # no fork of this threaded process
    results = context.Queue()
    procs = [
        context.Process(target=rank_main, args=(r, world, store.addresses, plan, results))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        per_rank = [_result(results, procs) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        store.close()
    medians: dict[str, dict[int, float]] = {}
    for method in METHODS:
        medians[method] = {}
        for numel in plan["sizes"]:
            slowest = [
                max(t[method][numel][i] for _, t in per_rank) for i in range(plan["repeats"])
            ]
            medians[method][numel] = statistics.median(slowest)
    return medians


def _result(results: Any, procs: list[Any]) -> Any:
    """The next rank's result; an error at once if a rank died without one."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(
                    f"a rank failed (exit codes {dead}); see its error above"
                ) from None
    raise TimeoutError("the ranks took more than 600 s")


def sent_per_rank(method: str, world: int, numel: int) -> float:
    """Megabytes each rank sends for one exchange of `numel` float32."""
    whole = method == METHODS[1] or (
        method == METHODS[0] and (world - 1) * numel * 4 < ALLGATHER_BELOW_BYTES
    )
    grads = (world - 1) if whole else 2 * (world - 1) / world
    return grads * numel * 4 / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,3,4")
    parser.add_argument("--sizes", default="10000,1000000,4000000", help="floats per gradient")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    plan = {"sizes": [int(s) for s in args.sizes.split(",")], "repeats": args.repeats}
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    for world in worlds:
        medians = measure(world, plan)
        for numel in plan["sizes"]:
            floor = medians[METHODS[2]][numel]
            for method in METHODS:
                seconds = medians[method][numel]
                rows.append(
                    {
                        "ranks": world,
                        "gradient_mb": numel * 4 / 1e6,
                        "method": method,
                        "ms": seconds * 1e3,
                        "vs_allreduce": seconds / floor,
                        "sent_per_rank_mb": sent_per_rank(method, world, numel),
                    }
                )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ("ranks", "gradient", "method", "ms", "x allreduce", "sent/rank")
    print("{:>5} {:>9} {:<26} {:>9} {:>11} {:>10}".format(*header))
    for row in rows:
        print(
            f"{row['ranks']:>5} {row['gradient_mb']:>7.2f}MB {row['method']:<26} "
            f"{row['ms']:>9.2f} {row['vs_allreduce']:>11.2f} {row['sent_per_rank_mb']:>8.2f}MB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
