"""A heal's donor side: the committed state served in chunks, and what one donor keeps of it.

A donor serves byte ranges of its committed tensors, lent to the transport (`DonorCache`). A
commit changes them in place, so a heal under way that a commit overtakes could not go on at
its step: one donor per heal, the one the heal took its layout from (the *keeper*), copies the
part the heal has not fetched yet as it commits (`_OldStep`) and serves the rest of the heal
from that copy. The other donors keep nothing: a request of theirs for a step they no longer
hold is answered with `Stale` (not an error), and the heal asks the keeper instead, or starts
again from the newest step if no donor holds its step. So the state a heal has not fetched is
copied once, not by every donor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from transport import Lent, get_logger

from ._heal_state import Chunk, Piece, StateLayout, describe, serve, state_tensors
from ._position import DataPositioned, Position, capture_position

if TYPE_CHECKING:
    import torch

#: The keeper keeps the old step of a heal that a commit overtook for this many commits: the
#: members keep as many updates for the replacement to catch up with (`KEEP_WHILE_HEALING`).
OLD_STEP_COMMITS = 2
#: How long a donor waits for the transport to report its sent chunks released.
_RELEASE_GRACE_S = 0.1


class HealingReplica(DataPositioned, Protocol):
    """The parts of a `Replica` that a heal reads and writes."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    committed_step: int


@dataclass(frozen=True)
class StepStart:
    """What a replica's step began with and may change before it is committed or dropped:
    copies of the model's buffers, and the data position and RNG states."""

    buffers: list[torch.Tensor]
    position: Position


@dataclass(frozen=True)
class Stale:
    """A donor's answer to a chunk request for a step it does not hold (it committed a later
    one and kept nothing of that step, or has not committed it yet): ask another donor."""

    asked: int
    committed: int

    def __str__(self) -> str:
        return (
            f"asked for the state of step {self.asked} but this replica has committed "
            f"{self.committed}: heal again from the current step"
        )


class DonorCache:
    """The donor's tensor list for the step it serves, built once per heal, not per chunk,
    and the chunks it lent to the transport. Cleared whenever a step begins
    (`Replica.prepare`): an abort replaces tensors, and a step changes them in place."""

    def __init__(self) -> None:
        self._step = -1
        self._tensors: list[tuple[str, torch.Tensor]] = []
        self._skeleton: Any = None
        self._lent: list[tuple[Lent, torch.Tensor]] = []
        self._keep = (-1, -1)  # (step, first tensor a heal may still ask for) as its keeper
        self._old = _OldStep()

    def clear(self) -> None:
        """Forget the tensors: the caller changes them next. A tensor with chunks the
        transport has not sent yet (to a receiver that stopped reading, or died) first moves
        to a copy of its memory, so that the bytes in flight stay those of the committed step;
        the old memory is freed once the transport drops them. Waits a moment at most: zmq
        reports a sent chunk released through a thread of pyzmq's, shortly after."""
        deadline = time.monotonic() + _RELEASE_GRACE_S
        unsent = {
            id(tensor): tensor
            for lent, tensor in self._lent
            if not lent.wait_released(max(deadline - time.monotonic(), 0.0))
        }
        if unsent:
            get_logger("recovery.heal").warning("heal_chunks_unsent", tensors=len(unsent))
        for tensor in unsent.values():
            tensor.data = tensor.data.clone()
        self._step, self._tensors, self._skeleton, self._lent = -1, [], None, []

    def commit(self, replica: HealingReplica, before: StepStart | None) -> None:
        """`replica` commits the step after its committed one now: as the keeper of a heal
        under way, first copy what that heal has not fetched yet (`_OldStep`), then clear."""
        step, (kept_step, first) = replica.committed_step, self._keep
        if kept_step == step:
            self._refresh(replica, step, False, before)
            self._old.commit(step, self._tensors, first)
        else:
            self._old.commit(-1, [], -1)
        self._keep = (-1, -1)
        self.clear()

    def layout(
        self,
        replica: HealingReplica,
        prepared: bool,
        before: StepStart | None = None,
        keep: bool = False,
    ) -> StateLayout:
        """The layout of `replica`'s committed state (`before`: a step is under way, which
        began with these buffers and this position). With `keep`, this donor is the keeper of
        the heal that asks (see the module)."""
        self._refresh(replica, replica.committed_step, prepared, before)
        if keep:
            self._keep = (replica.committed_step, 0)
        position = capture_position(replica) if before is None else before.position
        return describe(replica.committed_step, self._tensors, self._skeleton, position)

    def chunks(
        self,
        replica: HealingReplica,
        step: int,
        pieces: Sequence[Piece],
        prepared: bool,
        before: StepStart | None = None,
        keep_from: int = -1,
    ) -> list[Chunk] | Stale:
        """The bytes of `pieces` of `replica`'s committed state at `step` (or of the step
        before, for a heal that a commit overtook, from what the keeper kept of it); `Stale`
        if this donor does not hold them. `keep_from` (the keeper's requests only): the first
        tensor the heal may still ask for."""
        if prepared:
            raise RuntimeError("a step is prepared but not committed: its state is not final")
        if step != replica.committed_step:
            old = self._old.serve(step, pieces)
            return Stale(step, replica.committed_step) if old is None else old
        self._refresh(replica, step, prepared, before)
        if keep_from >= 0:
            self._keep = (step, keep_from)
        chunks = serve(self._tensors, pieces)
        self._lent = [entry for entry in self._lent if not entry[0].released]
        for (index, _, _), chunk in zip(pieces, chunks):
            if chunk.lent is not None:
                self._lent.append((chunk.lent, self._tensors[index][1]))
        return chunks

    def _refresh(
        self, replica: HealingReplica, step: int, prepared: bool, before: StepStart | None
    ) -> None:
        if prepared:
            raise RuntimeError("a step is prepared but not committed: its state is not final")
        if self._step != step:
            self._tensors, self._skeleton = state_tensors(replica.model, replica.optimizer)
            self._step = step
            if before is not None:  # the committed buffers, not those the forward pass changes
                saved = dict(zip(map(id, replica.model.buffers()), before.buffers))
                self._tensors = [(key, saved.get(id(t), t)) for key, t in self._tensors]


class _OldStep:
    """The keeper's copy of the part of its state that a heal under way has not asked for yet,
    taken as a commit overtakes the heal: the heal goes on at its step instead of starting
    again, and the replacement catches up on the steps committed since (from the updates the
    members keep while it heals). Its memory is the part not asked for yet, at most the state;
    it is dropped after `OLD_STEP_COMMITS` commits, past which that catch-up is no longer
    possible, or replaced when a heal under way at a later step is overtaken."""

    def __init__(self) -> None:
        self.step = -1
        self._tensors: list[tuple[str, torch.Tensor]] = []
        self._kept: set[int] = set()
        self._age = 0  # commits since it was taken

    def commit(self, step: int, tensors: list[tuple[str, torch.Tensor]], first: int) -> None:
        """The donor commits the step after `step`, whose `tensors` from index `first` on a
        heal may still ask for (step -1: this donor keeps nothing of the step it leaves)."""
        self._age += 1
        if step >= 0 and first >= 0:
            import torch

            empty = torch.empty(0)
            self.step, self._age = step, 0
            self._kept = set(range(first, len(tensors)))
            self._tensors = [
                (key, tensor.detach().clone() if index in self._kept else empty)
                for index, (key, tensor) in enumerate(tensors)
            ]
        elif self._age >= OLD_STEP_COMMITS:
            self.step, self._tensors, self._kept = -1, [], set()

    def serve(self, step: int, pieces: Sequence[Piece]) -> list[Chunk] | None:
        """The bytes of `pieces` at `step`; None if that is not the old step or any of them
        was not kept."""
        kept = all(isinstance(p, tuple) and p and p[0] in self._kept for p in pieces)
        if step != self.step or not kept:
            return None
        return serve(self._tensors, pieces)
