"""Bring your own training loop: a plain PyTorch script made fault tolerant with a few lines.

The plain data-parallel script, as each replica would run it (`rank` = its replica id)::

    def train(steps):
        torch.manual_seed(0)
        model, optimizer = build()
        loader = ShardLoader(shard=rank)
        for step in range(1, steps + 1):
            inputs, targets, _ = next(loader)
            loss = mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            dist.all_reduce(...)                                           # DDP's part
            optimizer.step()

The same loop under meshvisor (`train` below); the lines marked + are new or changed::

    def train(steps):
        torch.manual_seed(0)
        model, optimizer = build()
        loader = ShardLoader()
  +     manager = recovery.Manager(model, optimizer,
  +         data_state=loader.state_dict, load_data_state=loader.load_state_dict)
  +     loader.shard = manager.replica_id
  +     for step in manager.steps(steps):       # quorum; a replacement heals first
            inputs, targets, _ = next(loader)
            loss = mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
  +         manager.allreduce_gradients()       # fixed-order average over the live replicas
  +         if manager.should_commit():         # no: discarded, data and RNG put back
                optimizer.step()

and the controller launches it (`run_group`)::

    with recovery.LoopGroup(this_host(), train, steps, replicas=3, min_replicas=2) as group:
        results = group.run()

Run it: ``python examples/own_training_loop.py --replicas 3 --steps 8 --kill 1:4``. It trains
once without faults and once with replica 1 SIGKILLing itself in the middle of step 4
(`--kill`), then checks continuity: every replica ends with the parameters of the fault-free
run, bit for bit, and each committed step read the batch the fault-free run read there (none
twice, none skipped). That comparison holds because `--min-replicas` defaults to all of them,
so the survivors retry the discarded step once the replacement has healed; with fewer, the
group trains on without the dead replica's shard meanwhile, and only agreement is checked.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

import torch

import recovery
from mesh import this_host
from mesh.testing import signal_this_process

DIM = 8
BATCH = 4


class ShardLoader:
    """Batches of one shard, resumable like torchdata's StatefulDataLoader: its state is the
    number of batches read (the same on every replica), not this shard's indices."""

    def __init__(self, shard: int = 0) -> None:
        self.shard = shard
        self.batches_read = 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        batch_id = self.batches_read * 1000 + self.shard
        generator = torch.Generator().manual_seed(batch_id)  # not the global RNG
        inputs = torch.randn(BATCH, DIM, generator=generator)
        targets = inputs.sum(dim=1, keepdim=True) * 0.5
        self.batches_read += 1
        return inputs, targets, batch_id

    def state_dict(self) -> dict[str, int]:
        return {"batches_read": self.batches_read}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches_read = state["batches_read"]


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train(steps: int, kill: tuple[Any, ...] | None = None) -> dict[str, Any]:
    """One replica's loop. Dropout draws from torch's global RNG: a retried step draws the
    same masks. `kill` = (replica, step[, signal name]): that replica's first run sends itself
    the signal (SIGKILL, or SIGSTOP for a hang) there."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, optimizer = build()
    loader = ShardLoader()
    manager = recovery.Manager(
        model, optimizer, data_state=loader.state_dict, load_data_state=loader.load_state_dict
    )
    loader.shard = manager.replica_id
    read: list[tuple[int, int]] = []  # (step, batch id) of the committed steps
    for step in manager.steps(steps):
        inputs, targets, batch_id = next(loader)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        if kill and tuple(kill[:2]) == (manager.replica_id, step) and manager.incarnation == 0:
            signal_this_process(getattr(signal, (*kill, "SIGKILL")[2]))  # mid-step
        manager.allreduce_gradients()
        if manager.should_commit():
            optimizer.step()
            read.append((step, batch_id))
    return {
        "digest": recovery.parameter_digest(model),
        "read": read,
        "incarnation": manager.incarnation,
        "steps": manager.current_step(),
    }


def run_group(
    replicas: int,
    steps: int,
    kill: tuple[Any, ...] | None = None,
    min_replicas: int | None = None,
    **options: Any,
) -> tuple[dict[int, Any], recovery.LoopGroup]:
    """Train `replicas` copies of `train` on this host; their results and the group."""
    with recovery.LoopGroup(
        this_host(),
        train,
        steps,
        kill,
        replicas=replicas,
        min_replicas=min_replicas or replicas,
        **options,
    ) as group:
        return group.run(timeout_s=300), group


def continuity(clean: dict[int, Any], faulty: dict[int, Any]) -> list[str]:
    """What differs between a fault-free run's results and a run with failures."""
    problems = []
    for replica, result in faulty.items():
        expected = clean[replica]
        if result["digest"] != expected["digest"]:
            problems.append(f"replica {replica} ends with other parameters")
        first = result["read"][0][0] if result["read"] else None
        if result["read"] != [entry for entry in expected["read"] if entry[0] >= (first or 0)]:
            problems.append(f"replica {replica} read {result['read']}, not {expected['read']}")
        if result["incarnation"] == 0 and first != 1:
            problems.append(f"replica {replica} skipped steps before {first}")
    return problems


def _kill_spec(text: str) -> tuple[Any, ...]:
    replica, step, *sig = text.split(":")
    return (int(replica), int(step), *sig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--kill", default="1:4", help="REPLICA:STEP[:SIGNAL] (SIGKILL, SIGSTOP), or 'none'"
    )
    parser.add_argument("--min-replicas", type=int, default=None, help="default: all")
    args = parser.parse_args(argv)
    kill = None if args.kill == "none" else _kill_spec(args.kill)
    started = time.monotonic()
    clean, _ = run_group(args.replicas, args.steps)
    print(f"fault-free run: {args.steps} steps in {time.monotonic() - started:.1f} s")
    started = time.monotonic()
    faulty, group = run_group(args.replicas, args.steps, kill, args.min_replicas)
    print(f"run with --kill {args.kill}: {time.monotonic() - started:.1f} s")
    for outcome in group.outcomes:
        if not outcome.committed:
            print(
                f"  step {outcome.step} discarded after {outcome.seconds:.3f} s: {outcome.reason}"
            )
    for rec in group.recoveries:
        back = [
            f"{what} {at - rec.failed_at:.2f} s later"
            for what, at in [("healed", rec.healed_at), ("committed", rec.first_commit_at)]
            if at is not None
        ]
        print(f"  replica {rec.replica} failed ({rec.event}); {', '.join(back) or 'not back'}")
    digests = {result["digest"] for result in faulty.values()}
    problems = [] if len(digests) == 1 else [f"the replicas disagree: {digests}"]
    if args.min_replicas in (None, args.replicas):
        problems += continuity(clean, faulty)
    for problem in problems:
        print(f"  PROBLEM: {problem}")
    print(f"RESULT {'FAILED' if problems else 'OK'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
