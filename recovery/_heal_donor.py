"""A heal's donor side: the committed state served in chunks, straight from its memory.

A donor serves byte ranges of its committed tensors, lent to the transport (`DonorCache`). A
commit changes them in place: a request for a step the donor no longer holds (or does not
hold yet) is answered with `Stale`, not an error, and the heal asks another donor, or fetches
the rest at the newest step and replays the update on what it fetched before
(`_heal_groups`). So a donor never copies its state for a heal.
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

    def layout(
        self, replica: HealingReplica, prepared: bool, before: StepStart | None = None
    ) -> StateLayout:
        """The layout of `replica`'s committed state (`before`: a step is under way, which
        began with these buffers and this position)."""
        self._refresh(replica, replica.committed_step, prepared, before)
        position = capture_position(replica) if before is None else before.position
        return describe(replica.committed_step, self._tensors, self._skeleton, position)

    def chunks(
        self,
        replica: HealingReplica,
        step: int,
        pieces: Sequence[Piece],
        prepared: bool,
        before: StepStart | None = None,
    ) -> list[Chunk] | Stale:
        """The bytes of `pieces` of `replica`'s committed state at `step`; `Stale` if this
        donor does not hold that step."""
        if prepared:
            raise RuntimeError("a step is prepared but not committed: its state is not final")
        if step != replica.committed_step:
            return Stale(step, replica.committed_step)
        self._refresh(replica, step, prepared, before)
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
