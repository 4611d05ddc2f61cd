"""TorchFT-style replica training under chaos: the job that ``meshvisor demo`` runs.

A controller (this file's `workload`, run as the chaos harness's client) trains a small model
on synthetic data with N data-parallel replicas (`recovery.ReplicaGroup`) on a persistent
allocation of local host agents. The chaos harness kills replicas at random (SIGKILL, SIGTERM,
SIGSEGV). Each kill costs the survivors at most the step in flight; the dead replica is
re-spawned on the same allocation, heals from a live peer and rejoins. At the end the script
checks that every committed step was applied once, by every participant, bit for bit:
the final parameters must equal a single-process replay of the committed steps with the
recorded participant sets.

    meshvisor demo                         # 3 replicas, random kills, report and summary
    meshvisor demo --replicas 4 --mtbf 1.5 --duration 30 --seed 7 --report out.json
    python3 -m meshvisor demo              # the same
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from chaos import ChaosOptions, Job, RandomSchedule, run_chaos
from chaos import render as render_report
from recovery import Replica, ReplicaGroup, parameter_digest, replay_training

#: Each step of this toy model takes a few milliseconds; a real step takes longer. The
#: controller waits this long between steps so that faults land during training.
DEFAULT_PACE_S = 0.02


class Trainer(Replica):
    """A small MLP learning y = sin(sum(x)) from synthetic batches."""

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        )
        return model, torch.optim.Adam(model.parameters(), lr=3e-3)

    def loss(self, model: torch.nn.Module, step: int, shard: int) -> torch.Tensor:
        inputs, targets = batch(step, shard)
        return torch.nn.functional.mse_loss(model(inputs), targets)


def batch(step: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `shard` at `step`: deterministic, so a run can be replayed."""
    generator = torch.Generator().manual_seed(step * 100_003 + shard)
    inputs = torch.randn(64, 32, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True).sin()


def evaluate(model: torch.nn.Module) -> float:
    inputs, targets = batch(0, 99_999)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(inputs), targets))


def workload(job: Job) -> None:
    """The controller: train until the harness ends the run (or `steps` are committed)."""
    params = job.params
    group = ReplicaGroup(
        job.hosts,
        Trainer,
        replicas=params.get("replicas", 3),
        min_replicas=params.get("min_replicas", 2),
        heartbeat_timeout_s=1.0,
    )
    for replica in group.replicas:
        job.target(replica, heartbeat_timeout_s=1.0)
    steps, pace = params.get("steps", 10_000), params.get("pace_s", DEFAULT_PACE_S)
    discarded = 0
    started = time.monotonic()
    while job.running():
        if group.committed_steps >= steps:
            job.sleep(0.05)
            continue
        outcome = group.step()
        discarded += not outcome.committed
        job.record("training", _summary(group, discarded, time.monotonic() - started))
        job.sleep(pace)
    # The run is over: let the last replacements rejoin, and end with a step of all replicas.
    for _ in range(10):
        group.wait_for_all(timeout=30.0)
        outcome = group.step()
        if outcome.committed and len(outcome.participants) == len(group.replicas):
            break
    job.invariant("participants hold identical parameters", lambda: _consistent(group))
    job.invariant("the step counter moved by one", lambda: _contiguous(group))
    job.invariant("final parameters equal a replay", lambda: _replayed(group))
    job.record("training", _summary(group, discarded, time.monotonic() - started))


def _summary(group: ReplicaGroup, discarded: int, seconds: float) -> dict[str, Any]:
    recoveries = [
        round(r.first_commit_at - r.failed_at, 3)
        for r in group.recoveries
        if r.first_commit_at is not None
    ]
    later = [r.replica for r in group.recoveries]
    lost_again = sum(  # a replacement that failed in its turn before it committed
        r.first_commit_at is None and r.replica in later[i + 1 :]
        for i, r in enumerate(group.recoveries)
    )
    return {
        "committed_steps": group.committed_steps,
        "discarded_steps": discarded,
        "steps_per_s": round(group.committed_steps / seconds, 1) if seconds else 0.0,
        "replicas_lost": len(group.recoveries),
        "kill_to_first_commit_s": recoveries,
        "replacements_lost_before_committing": lost_again,
    }


def _consistent(group: ReplicaGroup) -> bool | str:
    problem = group.check_consistency()
    return problem or True


def _contiguous(group: ReplicaGroup) -> bool | str:
    steps = [step for step, _ in group.history]
    if steps != list(range(1, len(steps) + 1)):
        return f"committed steps are not 1..{len(steps)} in order: {steps[:20]}..."
    return True


def _replayed(group: ReplicaGroup) -> bool | str:
    replayed = replay_training(Trainer, group.history)
    status = group.status()
    live = {d for entries in status.values() for _, d in entries}
    if live != {parameter_digest(replayed)}:
        return "the replicas' parameters differ from the single-process replay"
    return True


def main(argv: list[str] | None = None, prog: str = "meshvisor demo") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10_000, help="stop after this many")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--mtbf", type=float, default=2.0, help="mean seconds between kills")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds of kills")
    parser.add_argument("--pace", type=float, default=DEFAULT_PACE_S, help="seconds between steps")
    parser.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    schedule = RandomSchedule(
        seed=args.seed,
        mtbf_s=args.mtbf,
        duration_s=args.duration,
        warmup_s=1.0,
        faults=(("kill", 1.0),),
        settle_s=1.0,
    )
    options = ChaosOptions(
        hosts=2,
        preload=("torch", "torch.distributed", "torch._dynamo", "chaos"),  # as ReplicaGroup asks
        on_update=print,
        params={
            "replicas": args.replicas,
            "min_replicas": args.min_replicas,
            "steps": args.steps,
            "pace_s": args.pace,
        },
    )
    print(
        f"training {args.replicas} replicas; killing one every ~{args.mtbf:g} s (seed {args.seed})"
    )
    report = run_chaos(f"{Path(__file__).resolve()}:workload", schedule, options)
    render_report(report)
    training = report.workload_stats.get("training", {})
    print("\nTraining summary")
    for key, value in training.items():
        print(f"  {key.replace('_', ' ')}: {value}")
    if args.report is not None:
        report.to_json(args.report)
    return 0 if report.ok else 1
