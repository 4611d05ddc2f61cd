"""TorchFT-style replica recovery: kill to the replacement committing again, and step
throughput with and without faults, without hot spares and with them, in the same run.

Three replicas of the demo's model (meshvisor/_demo.py) train on the local host, once per
`--spares` count (0: a dead replica is re-spawned and healed; K: one of K standby replicas
takes its place). Each time, first without faults (the baseline), then with a SIGKILL of a
random replica every `--every` steps: for each kill, the time until the replica's place
commits a step again, and how many steps the survivors lost. Prints a table per count and one
comparing them. Targets: kill to replacement participating <= 2 s (issue #6), <= 50 ms with a
spare (issue #16); survivors lose at most the step in flight. For reference, TorchFT 0.2.0
measured on this machine took ~5.8 s from a kill to the replacement's first commit.

    python3 benchmarks/bench_replicas.py [--kills 8] [--every 40] [--spares 0,1] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("MESHVISOR_PRELOAD", "torch,torch._dynamo,chaos")  # fast replacements
os.environ.setdefault("MESHVISOR_LOG_LEVEL", "error")

from mesh import this_host
from mesh.testing import probe
from meshvisor._demo import Trainer
from recovery import ReplicaGroup

TARGET_S = 2.0
SPARE_TARGET_S = 0.05
TORCHFT_S = 5.8


def steps_per_second(group: ReplicaGroup, steps: int) -> float:
    started = time.perf_counter()
    target = group.committed_steps + steps
    while group.committed_steps < target:
        group.step()
    return steps / (time.perf_counter() - started)


def with_kills(
    group: ReplicaGroup, kills: int, every: int, rng: random.Random
) -> tuple[list[float], list[int], float, list[float]]:
    """Kill a replica every `every` steps; (kill to first commit s, steps lost per kill,
    steps per second over the whole phase, kill to the group noticing it s). Before each
    kill the group waits, without stepping, for its replacements and spares to be ready (so
    that every kill finds the same group); that wait is not counted in the steps per second:
    a training loop would go on stepping meanwhile."""
    recovered: list[float] = []
    noticed: list[float] = []
    lost: list[int] = []
    started = time.perf_counter()
    begin = group.committed_steps
    waited = 0.0
    for _ in range(kills):
        steps_per_second(group, every)
        before_wait = time.perf_counter()
        group.wait_for_all()
        waited += time.perf_counter() - before_wait
        victim = rng.randrange(len(group.replicas))
        pid = int(next(iter(probe(group.replicas[victim]).get(timeout=30).values())))
        discarded_before = sum(not o.committed for o in group.outcomes)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        recoveries_before = len(group.recoveries)
        while len(group.recoveries) == recoveries_before or (
            group.recoveries[-1].first_commit_at is None
        ):
            group.step()
        recovered.append(group.recoveries[-1].first_commit_at - killed_at)  # type: ignore[operator]
        noticed.append(group.recoveries[-1].failed_at - killed_at)
        lost.append(sum(not o.committed for o in group.outcomes) - discarded_before)
    rate = (group.committed_steps - begin) / (time.perf_counter() - started - waited)
    return recovered, lost, rate, noticed


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def print_table(result: dict[str, object], every: int, baseline: float, faulty: float) -> None:
    print(f"-- spares={result['spares']}")
    recovery: dict[str, float] = result["kill_to_first_commit_s"]  # type: ignore[assignment]
    lost = result["steps_lost_per_kill_max"]
    rows = [
        ("kill to replacement committing, p50", f"{recovery['p50']:.3f} s"),
        ("kill to replacement committing, p99", f"{recovery['p99']:.3f} s"),
        ("kill to replacement committing, max", f"{recovery['max']:.3f} s"),
        ("steps lost by the survivors per kill, max", str(lost)),
        ("steps/s without faults (baseline)", f"{baseline:.1f}"),
        (f"steps/s with a kill every {every} steps", f"{faulty:.1f} ({faulty / baseline:.2f}x)"),
        ("replicas identical at the end", "yes" if result["consistent"] else "NO"),
        ("slowest step with kills", f"{result['slowest_step_with_kills_s']:.3f} s"),
    ]
    phases: dict[str, float] = result["phases_median_s"]  # type: ignore[assignment]
    rows += [(f"  median, {k}", f"{v:.3f} s") for k, v in phases.items()]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    target = SPARE_TARGET_S if result["spares"] else TARGET_S
    verdict = "PASS" if recovery["p99"] <= target and int(lost) <= 1 else "MISS"  # type: ignore[call-overload]
    print(f"target: p99 <= {target} s, at most 1 step lost per kill: {verdict}")


def print_comparison(results: list[dict[str, Any]]) -> None:
    """One row per spare count: kill to commit, steps lost, goodput with kills."""
    print(
        "| spares | kill to commit p50 | p99 | max | steps lost/kill max | steps/s no faults | "
        "steps/s with kills | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        k = r["kill_to_first_commit_s"]
        base, faulty = r["steps_per_s_without_faults"], r["steps_per_s_with_faults"]
        print(
            f"| {r['spares']} | {k['p50']:.3f} s | {k['p99']:.3f} s | {k['max']:.3f} s | "
            f"{r['steps_lost_per_kill_max']} | {base:.1f} | {faulty:.1f} | {faulty / base:.2f} |"
        )
    print(f"reference: TorchFT 0.2.0 took ~{TORCHFT_S} s from a kill to the first commit")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--every", type=int, default=40, help="steps between kills")
    parser.add_argument("--baseline-steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spares", default="0,1", help="spare counts to compare, in order")
    parser.add_argument(
        "--follow-every",
        type=int,
        default=0,
        help="spares follow every N steps and replicas keep 2N updates (0: the defaults); "
        "a spare is then up to 2N-1 updates behind at a kill, which its take-over applies",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [run(args, int(count)) for count in args.spares.split(",")]
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for result in results:
            print_table(
                result,
                args.every,
                result["steps_per_s_without_faults"],
                result["steps_per_s_with_faults"],
            )
        print_comparison(results)
    return 0 if all(result["consistent"] for result in results) else 1


def run(args: argparse.Namespace, spares: int) -> dict[str, Any]:
    """One group with `spares` spares: the baseline, then the kills; the result."""
    trainer = Trainer
    if args.follow_every:

        class Lagging(Trainer):
            standby_follow_every = args.follow_every
            standby_updates = 2 * args.follow_every

        trainer = Lagging
    group = ReplicaGroup(
        this_host(), trainer, replicas=args.replicas, heartbeat_timeout_s=1.0, spares=spares
    )
    try:
        steps_per_second(group, 20)  # warm up
        baseline = steps_per_second(group, args.baseline_steps)
        first_with_kills = len(group.outcomes)
        recovered, lost, faulty, noticed = with_kills(
            group, args.kills, args.every, random.Random(args.seed)
        )
        problem = group.check_consistency()
    finally:
        group.close()
    phases = {
        "killed -> noticed": noticed,
        "noticed -> up": [r.respawned_at - r.failed_at for r in group.recoveries if r.respawned_at],
        "up -> healed": [
            r.healed_at - r.respawned_at for r in group.recoveries if r.healed_at and r.respawned_at
        ],
        "healed -> committing": [
            r.first_commit_at - r.healed_at
            for r in group.recoveries
            if r.first_commit_at and r.healed_at
        ],
    }
    result = {
        "spares": spares,
        "by_spare": sum(r.by_spare for r in group.recoveries),
        "replicas": args.replicas,
        "kills": args.kills,
        "kill_to_first_commit_s": {
            "p50": statistics.median(recovered),
            "p99": nearest_rank(recovered, 0.99),
            "max": max(recovered),
        },
        "steps_lost_per_kill_max": max(lost),
        "steps_per_s_without_faults": baseline,
        "steps_per_s_with_faults": faulty,
        "consistent": problem is None,
        # a step that waited for something off its path (a spare's formation, say) shows here
        "slowest_step_with_kills_s": max(o.seconds for o in group.outcomes[first_with_kills:]),
        "phases_median_s": {k: statistics.median(v) for k, v in phases.items() if v},
    }
    return result


if __name__ == "__main__":
    sys.exit(main())
