"""Page faults and CPU of a replica-like step's tensor allocations under each malloc setting.

Each setting runs in a fresh process (glibc reads ``GLIBC_TUNABLES`` at start, torch reads
``THP_MEM_ALLOC_ENABLE`` at its first tensor), the settings alternating, `--runs` times: a
model of `--mb` MB in `--layers` tensors; each round makes a gradient per layer with a small
allocation behind it, concatenates them (the exchange's buffer), and runs Adam's arithmetic
with its temporaries. Counted over the rounds after the first, from /proc/self/stat (minor
faults, user and system CPU), so the counts do not depend on the machine's load.

    python3 benchmarks/bench_tensor_alloc.py [--mb 100] [--layers 25] [--rounds 10] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from recovery import TENSOR_MALLOC

SETTINGS = {
    "glibc defaults": {"GLIBC_TUNABLES": "", "THP_MEM_ALLOC_ENABLE": "0"},
    "TENSOR_MALLOC": {"GLIBC_TUNABLES": TENSOR_MALLOC, "THP_MEM_ALLOC_ENABLE": "0"},
    "huge pages": {"GLIBC_TUNABLES": "", "THP_MEM_ALLOC_ENABLE": "1"},
    "TENSOR_MALLOC + huge pages": {"GLIBC_TUNABLES": TENSOR_MALLOC, "THP_MEM_ALLOC_ENABLE": "1"},
}
COLUMNS = ("faults", "cpu_s", "sys_s", "wall_s", "rss_mb", "huge_mb")


def counters() -> tuple[int, float, float]:
    """This process's minor faults, CPU seconds and system CPU seconds so far."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[7]), (int(fields[11]) + int(fields[12])) / tick, int(fields[12]) / tick


def memory_mb() -> dict[str, int]:
    """Resident memory and the part of it on transparent huge pages, in MiB."""
    values = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "AnonHugePages"):
            values[name] = int(rest.split()[0]) // 1024
    return {"rss_mb": values["Rss"], "huge_mb": values["AnonHugePages"]}


def child(mb: int, layers: int, rounds: int) -> dict[str, float]:
    """One setting's rounds, in this process (its environment holds the setting)."""
    import torch

    torch.set_num_threads(1)
    width = mb * 2**20 // 4 // layers
    params = [torch.randn(width) for _ in range(layers)]
    moments = [(torch.zeros(width), torch.zeros(width)) for _ in range(layers)]
    small: list[torch.Tensor] = []

    def one_round(index: int) -> None:
        grads = []
        for param in params:
            grads.append(param * 0.5 + 1.0)  # forward and backward temporaries
            small.append(torch.empty(37 + index))  # a small allocation behind a big one
        flat = torch.cat(grads) / 2.0  # the exchange's buffer
        for param, (mean, square), grad in zip(params, moments, flat.split(width), strict=True):
            mean.mul_(0.9).add_(grad, alpha=0.1)
            square.mul_(0.99).addcmul_(grad, grad, value=0.01)
            param.addcdiv_(mean, square.sqrt().add_(1e-8), value=-1e-3)
        del small[: max(0, len(small) - 2 * layers)]

    one_round(0)
    faults, cpu, system = counters()
    started = time.perf_counter()
    for index in range(1, rounds + 1):
        one_round(index)
    wall = time.perf_counter() - started
    after = counters()
    costs = {"faults": after[0] - faults, "cpu_s": after[1] - cpu, "sys_s": after[2] - system}
    return {**costs, "wall_s": wall, **memory_mb()}


def run_setting(name: str, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, **SETTINGS[name], "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--child", str(args.mb), str(args.layers)]
    command.append(str(args.rounds))
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=100, help="the model's parameters, MB")
    parser.add_argument("--layers", type=int, default=25, help="tensors the model is split in")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--runs", type=int, default=2, help="alternations of every setting")
    parser.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    print(f"{args.mb} MB in {args.layers} tensors, {args.rounds} rounds; load {os.getloadavg()}")
    print("| setting | run | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for run in range(1, args.runs + 1):
        for name in SETTINGS:
            row = run_setting(name, args)
            cells = " | ".join(f"{row[column]:.2f}".rstrip("0").rstrip(".") for column in COLUMNS)
            print(f"| {name} | {run} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
