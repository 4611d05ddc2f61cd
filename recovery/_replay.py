"""`replay_training`: a run recomputed in one process from its history of committed steps,
the model a correct run must end with (the tests compare the replicas with it bit for bit)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._arithmetic import apply_average, local_gradient
from ._exchange import average

if TYPE_CHECKING:
    import torch

    from ._replica import Replica


def replay_training(
    replica_class: type[Replica],
    history: Sequence[tuple[int, Sequence[int]]],
    ranks_per_replica: int = 1,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Recompute a run in this process from its `history` of committed steps ((step,
    participating replica ids), in order): the model a correct run must end with."""
    import torch

    threads = torch.get_num_threads()
    try:
        replica = replica_class(*args, **(kwargs or {}))  # sets one thread, builds the model
        for step, participants in history:
            shards = [
                r * ranks_per_replica + k for r in participants for k in range(ranks_per_replica)
            ]
            grads = [
                local_gradient(replica.model, replica.loss(replica.model, step, shard))
                for shard in shards
            ]
            apply_average(replica.model, replica.optimizer, average(grads))
        return replica.model
    finally:
        torch.set_num_threads(threads)
