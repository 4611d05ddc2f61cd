"""`Replica`: the actor side of TorchFT-style replica training (needs torch).

A replica holds a full copy of the model and its optimizer. Each step is two-phase: `prepare`
computes the local gradient, averages it with every participant's over a gloo process group
(a reduce-scatter and an all-gather, summed in a fixed order: `_exchange`) and applies the
optimizer, keeping a backup; `commit` drops the
backup, `abort` restores it. So a step is applied everywhere or nowhere, and every participant
ends it with bitwise-identical parameters. A replacement replica heals by pulling the state of
a live peer straight from that peer's actor (tensors travel out of band, zero-copy).

The step arithmetic lives in plain functions shared with `replay_training`, which recomputes a
run in one process from its history: the result must equal the replicas' parameters bit for
bit, which is how the tests prove that no step was lost, applied twice or half-applied.

Healing streams the state in chunks from every live peer at once (`_heal`), data position and
RNG states included (`_position`); a discarded step puts the data position and RNG states back.
"""

from __future__ import annotations

import ctypes
import datetime
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mesh import Actor, context, endpoint

from ._aborts import AbortWatch
from ._exchange import average, exchange_average, run_unless_aborted
from ._heal import DonorCache, HealReport, endpoints_of, heal
from ._heal_state import Chunk, Piece, StateLayout
from ._position import Position, capture_position, restore_position

if TYPE_CHECKING:
    import torch

    from mesh import ActorMesh


class Replica(Actor):
    """Base class of a training replica; subclass it and implement `build` and `loss`.

    ``build()`` returns ``(model, optimizer)`` built deterministically (seed torch first), and
    ``loss(model, step, shard)`` the loss of the batch that `shard` trains on at `step`
    (deterministic in both). Shard ``replica_id * ranks_per_replica + rank`` is this rank's.
    A replica that reads batches from a data loader also implements `data_state` and
    `load_data_state`, so that a replacement goes on from the group's position.
    """

    #: Healing moves the state in chunks of this many bytes, this many in flight per peer.
    heal_chunk_bytes: int = 8 << 20
    heal_window: int = 4
    heal_timeout_s: float = 60.0

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)  # reductions in the same order everywhere: bitwise replays
        self.model, self.optimizer = self.build()
        self.committed_step = 0  # the number of steps committed so far
        self.replica_id = -1
        self.ranks_per_replica = 1
        self._aborts: AbortWatch | None = None
        self._group: Any = None
        self._quorum = -1
        self._backup: dict[str, Any] | None = None
        self._position: Position | None = None  # before the step in progress, for abort
        self._donor = DonorCache()
        self.last_heal: HealReport | None = None

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        raise NotImplementedError("a Replica subclass must implement build()")

    def loss(self, model: torch.nn.Module, step: int, shard: int) -> torch.Tensor:
        raise NotImplementedError("a Replica subclass must implement loss(model, step, shard)")

    def on_phase(self, phase: str, step: int) -> None:
        """Called as each phase of a step begins ("join" when the group is formed for it,
        "forward", "allreduce", "apply", "commit"); override to instrument a replica (or, in
        tests, to make it fail at a chosen point). A donor also calls it as it sends each
        chunk of a heal: ("heal", committed step)."""

    def data_state(self) -> Any:
        """The position of this replica's data loader after the committed steps: small,
        picklable, and the same for every replica (a count of batches, an epoch, not this
        shard's indices). The default None suits `loss` that picks batches by step alone."""
        return None

    def load_data_state(self, state: Any) -> None:
        """Put this replica's data loader at `state` (from `data_state` of a peer, or of this
        replica before a discarded step), for this replica's own shard."""

    # -- membership ---------------------------------------------------------------------------

    @endpoint
    def configure(self, replica_id: int, ranks_per_replica: int) -> None:
        self.replica_id = replica_id
        self.ranks_per_replica = ranks_per_replica

    @endpoint
    def join(
        self,
        quorum: int,
        base: int,
        world: int,
        store: tuple[str, int],
        timeout_s: float,
        step: int = 0,
    ) -> None:
        """Enter the process group of `quorum` (a fresh one per membership) for `step`: this
        replica's ranks take the group ranks from `base` on. Gives up as soon as the group's
        controller says that a member failed (`ExchangeAborted`)."""
        import torch.distributed as dist

        self.on_phase("join", step)
        rank = base + context().rank.rank
        timeout = datetime.timedelta(seconds=timeout_s)
        self._group = None  # the old group: its peers may be gone
        self._quorum = -1
        if self._aborts is None:
            self._aborts = AbortWatch(store, timeout_s)
        self._aborts.quorum = quorum
        # A store client of its own: an abandoned rendezvous may still hold its connection.
        client = dist.TCPStore(  # type: ignore[attr-defined]
            store[0], store[1], is_master=False, timeout=timeout
        )
        prefixed = dist.PrefixStore(f"quorum-{quorum}", client)  # type: ignore[attr-defined]
        self._group = run_unless_aborted(
            lambda: dist.ProcessGroupGloo(prefixed, rank, world, timeout), self._aborts
        )
        self._quorum = quorum

    # -- one step -----------------------------------------------------------------------------

    @endpoint
    def prepare(self, step: int, quorum: int, world: int) -> str:
        """Phase one of `step`: gradient, exchange (the average), apply (with a backup).
        Returns the digest of the resulting parameters."""
        if quorum != self._quorum or self._group is None:
            raise RuntimeError(f"replica {self.replica_id} is not in quorum {quorum}")
        if step != self.committed_step + 1:
            raise RuntimeError(
                f"replica {self.replica_id} asked to prepare step {step} after committing "
                f"{self.committed_step}"
            )
        shard = self.replica_id * self.ranks_per_replica + context().rank.rank
        self._position = capture_position(self)  # the data and RNG a retry must see again
        self._donor.clear()
        self.on_phase("forward", step)
        local = local_gradient(self.model, self.loss(self.model, step, shard))
        self.on_phase("allreduce", step)
        assert self._aborts is not None  # set by join
        averaged = exchange_average(self._group, local, self._aborts)
        self.on_phase("apply", step)
        self._backup = _snapshot(self.model, self.optimizer)
        apply_average(self.model, self.optimizer, averaged)
        return digest(self.model)

    @endpoint
    def commit(self, step: int) -> int:
        if self._backup is None or step != self.committed_step + 1:
            raise RuntimeError(f"replica {self.replica_id} has no prepared step {step}")
        self.on_phase("commit", step)
        self._backup = self._position = None
        self.committed_step = step
        return self.committed_step

    @endpoint
    def abort(self, step: int) -> int:
        """Undo a prepared step (if any): the parameters are those of the last commit."""
        if self._backup is not None:
            _restore(self.model, self.optimizer, self._backup)
            self._backup = None
        if self._position is not None:
            restore_position(self, self._position)
            self._position = None
        return self.committed_step

    # -- state ----------------------------------------------------------------------------------

    @endpoint
    def state(self) -> dict[str, Any]:
        """The committed state, for a replacement to heal from (tensors go out of band)."""
        if self._backup is not None:
            raise RuntimeError("a step is prepared but not committed: its state is not final")
        return {
            "step": self.committed_step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    @endpoint
    def heal_from(self, peers: ActorMesh[Replica] | Sequence[ActorMesh[Replica]]) -> HealReport:
        """Take the committed state of `peers` (live replicas; from each, the rank matching
        this one), in chunks spread over all of them; see `recovery._heal`."""
        meshes = [peers] if not isinstance(peers, Sequence) else list(peers)
        donors = []
        for mesh in meshes:
            ranks = mesh.flatten("rank")
            donors.append(endpoints_of(ranks.slice(rank=context().rank.rank % len(ranks))))
        self._backup = self._position = None
        self._donor.clear()
        self.last_heal = heal(
            self, donors, self.heal_chunk_bytes, self.heal_window, self.heal_timeout_s
        )
        return self.last_heal

    @endpoint
    def heal_layout(self) -> StateLayout:
        """The layout of the committed state, for a replacement healing from this replica."""
        return self._donor.layout(self, prepared=self._backup is not None)

    @endpoint
    def heal_chunks(self, step: int, pieces: Sequence[Piece]) -> list[Chunk]:
        """Bytes of the committed state of `step` (tensor, start, stop), sent from memory."""
        self.on_phase("heal", step)
        return self._donor.chunks(self, step, pieces, prepared=self._backup is not None)

    @endpoint
    def status(self) -> tuple[int, str]:
        """The committed step and the digest of the parameters."""
        return self.committed_step, digest(self.model)

    @endpoint
    def parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())


# -- the step arithmetic, shared with the replay ---------------------------------------------


def local_gradient(model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """The gradient of `loss` over the model's parameters, flattened into one tensor."""
    import torch

    model.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    grads = [
        p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
        for p in model.parameters()
    ]
    return torch.cat(grads).detach()


def apply_gradient(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, gathered: Sequence[torch.Tensor]
) -> None:
    """Average `gathered` (one flat gradient per participant, in participant order: the same
    order everywhere, so the same bits everywhere) and take an optimizer step with it."""
    apply_average(model, optimizer, average(gathered))


def apply_average(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, averaged: torch.Tensor
) -> None:
    """Take an optimizer step with the flat averaged gradient `averaged`."""
    offset = 0
    for param in model.parameters():
        count = param.numel()
        param.grad = averaged[offset : offset + count].view_as(param).clone()
        offset += count
    optimizer.step()


def digest(model: torch.nn.Module) -> str:
    """A hash of the parameters' bits: equal digests, identical parameters. Torch alone is
    enough (no numpy): each tensor's memory is hashed in place, through a ctypes view."""
    hasher = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        hasher.update(name.encode())
        dense = tensor.detach().resolve_conj().resolve_neg().contiguous().cpu()
        if dense.nbytes:  # `dense` outlives the view: it owns the memory hashed
            hasher.update((ctypes.c_ubyte * dense.nbytes).from_address(dense.data_ptr()))
    return hasher.hexdigest()


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
            apply_gradient(replica.model, replica.optimizer, grads)
        return replica.model
    finally:
        torch.set_num_threads(threads)


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    import copy

    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(optimizer.state_dict()),
    }


def _restore(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, backup: dict[str, Any]
) -> None:
    model.load_state_dict(backup["model"])
    optimizer.load_state_dict(backup["optimizer"])
