"""What a hot spare costs the fault-free step: a group without spares and one with a spare,
stepped in alternate blocks in the same process, so each ratio compares blocks run seconds
apart (on a shared machine, steps/s alone moves with the load).

Per block: steps/s, the median and slowest step, and per committed step the CPU time (ms) and
minor page faults of the controller and of each replica's and spare's process (from /proc:
less sensitive to the load than steps/s). Sizes as in bench_goodput.py ("demo": the demo's
model; "100MB", "1GB": Linear layers with Adam). Take /tmp/tasks/bigmem.lock (flock) for the
big sizes where several people share a machine.

    python3 benchmarks/bench_spare_cost.py [--size demo] [--blocks 3] [--steps 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("MESHVISOR_PRELOAD", "torch,torch._dynamo,chaos")
os.environ.setdefault("MESHVISOR_LOG_LEVEL", "error")

import torch

from mesh import this_host
from mesh.testing import probe
from meshvisor._demo import Trainer
from recovery import Replica, ReplicaGroup

#: width, layers, rows of a batch (as in bench_goodput.py)
WIDE = {"100MB": (1024, 8, 16), "1GB": (4096, 5, 8)}


class WideTrainer(Replica):
    """Linear(width, width) layers with Adam, synthetic batches."""

    def __init__(self, size: str) -> None:
        self.width, self.layers, self.rows = WIDE[size]
        super().__init__()

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(self.layers):
            layers += [torch.nn.Linear(self.width, self.width), torch.nn.Tanh()]
        model = torch.nn.Sequential(*layers[:-1])
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)

    def loss(self, model: torch.nn.Module, step: int, shard: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(step * 100_003 + shard)
        inputs = torch.randn(self.rows, self.width, generator=generator)
        return torch.nn.functional.mse_loss(model(inputs), inputs.sin())


def pids(meshes: list[Any]) -> list[int]:
    return [int(v) for mesh in meshes for v in probe(mesh).get(timeout=60).values()]


def proc_counters(pid: int) -> tuple[float, int]:
    """(CPU seconds, minor page faults) of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def block(group: ReplicaGroup, steps: int) -> dict[str, Any]:
    """Step `group` `steps` times; what it cost."""
    procs = pids(group.replicas) + pids(group.spare_replicas)
    before = [proc_counters(pid) for pid in procs]
    mine, first, started = os.times(), len(group.outcomes), time.perf_counter()
    start_step = group.committed_steps
    while group.committed_steps < start_step + steps:
        group.step()
    wall, now = time.perf_counter() - started, os.times()
    after = [proc_counters(pid) for pid in procs]
    done = group.committed_steps - start_step
    seconds = sorted(o.seconds for o in group.outcomes[first:])
    controller = (now.user + now.system) - (mine.user + mine.system)
    return {
        "steps_per_s": done / wall,
        "median_step_s": statistics.median(seconds),
        "slowest_step_s": seconds[-1],
        "controller_cpu_ms": round(controller / done * 1000, 2),
        "cpu_ms": [round((b[0] - a[0]) / done * 1000, 2) for a, b in zip(before, after)],
        "faults": [round((b[1] - a[1]) / done) for a, b in zip(before, after)],
        "ready_spares": group.ready_spares(),
        "load": os.getloadavg()[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="demo", choices=["demo", *WIDE])
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300, help="steps per block")
    args = parser.parse_args()
    args_of: tuple[Any, ...] = () if args.size == "demo" else (args.size,)
    trainer: type[Replica] = Trainer if args.size == "demo" else WideTrainer
    groups = {
        spares: ReplicaGroup(
            this_host(),
            trainer,
            *args_of,
            replicas=3,
            heartbeat_timeout_s=1.0,
            spares=spares,
            name=f"cost{spares}",
            step_timeout_s=120.0,
        )
        for spares in (0, 1)
    }
    rates: dict[int, list[float]] = {0: [], 1: []}
    try:
        for group in groups.values():
            group.wait_for_all(timeout=600)
            for _ in range(5):
                group.step()
            group.wait_for_all(timeout=600)
        for number in range(args.blocks):
            for spares, group in groups.items():
                result = block(group, args.steps)
                rates[spares].append(result["steps_per_s"])
                print(
                    f"block {number} spares={spares} "
                    + " ".join(
                        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in result.items()
                    ),
                    flush=True,
                )
    finally:
        for group in groups.values():
            group.close()
    ratios = [round(b / a, 3) for a, b in zip(rates[0], rates[1])]
    print(f"steps/s with a spare / without, per block: {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
