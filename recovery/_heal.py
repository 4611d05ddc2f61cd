"""Healing: a replacement pulls the committed state of live peers in chunks, several at once.

The receiver asks one donor for the layout of its state (`_heal_state.StateLayout`), plans
fixed-size chunks over the tensors' bytes and keeps up to `window` chunk requests in flight
per donor; whichever donor has room takes the next chunk, so the donors send disjoint subsets
and a faster one sends more. Each reply is copied into the preallocated tensors and dropped:
the extra memory on either side is the chunks in flight, not a copy of the state. A donor that
dies (or does not answer within `timeout_s`) loses its chunks to the others; the heal fails
only when no donor is left. Every request names the committed step, and a donor refuses one
for any other step, so a heal never mixes two states.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from supervision import SupervisionError
from transport import Lent, get_logger

from ._heal_state import (
    Chunk,
    Piece,
    StateLayout,
    Targets,
    describe,
    plan_chunks,
    serve,
    state_tensors,
)
from ._position import DataPositioned, Position, capture_position, restore_position

if TYPE_CHECKING:
    import torch

    from mesh import ActorMesh, Future

#: A donor keeps the old step of a heal that a commit overtook for this many commits: the
#: members keep as many updates for the replacement to catch up with (`KEEP_WHILE_HEALING`).
OLD_STEP_COMMITS = 2
#: How long a donor waits for the transport to report its sent chunks released.
_RELEASE_GRACE_S = 0.1


@dataclass(frozen=True)
class HealReport:
    """What one heal moved: the step healed to, bytes, seconds, and chunks per donor. A
    replacement's heal (`Replica.rejoin`) may end with a catch-up on the steps the group
    committed meanwhile: then `step` is the step reached, `updates` how many it applied,
    `digest` that of its parameters there (for the group to check: `_rejoin`), and `seconds`
    count the catch-up too."""

    step: int
    nbytes: int
    seconds: float
    chunks_per_donor: tuple[int, ...]  # in the order the donors were given
    lost_donors: tuple[int, ...]  # donors that died or went silent during the heal
    allocated_bytes: int  # new tensors the receiver made (state it did not hold before)
    updates: int = 0  # committed updates applied after the heal
    digest: str = ""  # of the parameters at `step`, when updates were applied

    @property
    def gigabytes_per_second(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


class HealingReplica(DataPositioned, Protocol):
    """The parts of a `Replica` that a heal reads and writes."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    committed_step: int


# -- the donor's side ------------------------------------------------------------------------


class DonorCache:
    """The donor's tensor list for the step it serves, built once per heal, not per chunk,
    and the chunks it lent to the transport. Cleared whenever a step begins
    (`Replica.prepare`): an abort replaces tensors, and a step changes them in place."""

    def __init__(self) -> None:
        self._step = -1
        self._tensors: list[tuple[str, torch.Tensor]] = []
        self._skeleton: Any = None
        self._lent: list[tuple[Lent, torch.Tensor]] = []
        self._asked = -1  # the highest tensor index a heal asked for at `_step`
        self._old = _OldStep()

    def clear(self, keep_old: bool = False) -> None:
        """Forget the tensors: the caller changes them next. A tensor with chunks the
        transport has not sent yet (to a receiver that stopped reading, or died) first moves
        to a copy of its memory, so that the bytes in flight stay those of the committed step;
        the old memory is freed once the transport drops them. Waits a moment at most: zmq
        reports a sent chunk released through a thread of pyzmq's, shortly after. With
        `keep_old` (a commit), a heal under way goes on across it (`_OldStep`)."""
        if keep_old:
            self._old.commit(self._step, self._tensors, self._asked)
        self._asked = -1
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
    ) -> list[Chunk]:
        """The bytes of `pieces` of `replica`'s committed state at `step` (or of the step
        before, for a heal that a commit overtook, from what was kept of it)."""
        if step != replica.committed_step and step == self._old.step and not prepared:
            return self._old.serve(pieces, _refusal(step, replica.committed_step))
        self._refresh(replica, step, prepared, before)
        chunks = serve(self._tensors, pieces)
        self._asked = max([self._asked] + [p[0] for p in pieces])
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
        if step != replica.committed_step:
            raise RuntimeError(_refusal(step, replica.committed_step))
        if self._step != step:
            self._tensors, self._skeleton = state_tensors(replica.model, replica.optimizer)
            self._step = step
            if before is not None:  # the committed buffers, not those the forward pass changes
                saved = dict(zip(map(id, replica.model.buffers()), before.buffers))
                self._tensors = [(key, saved.get(id(t), t)) for key, t in self._tensors]


class _OldStep:
    """A donor's copy of the part of its state that a heal under way has not asked for yet,
    taken as a commit overtakes the heal: the heal goes on at its step instead of starting
    again, and the group catches the replacement up on the steps committed since (from the
    updates the members keep while it heals). Its memory is the part not asked for yet, at
    most the state; it is dropped after `OLD_STEP_COMMITS` commits, past which that catch-up
    is no longer possible, or replaced when a heal asks for a later step."""

    def __init__(self) -> None:
        self.step = -1
        self._tensors: list[tuple[str, torch.Tensor]] = []
        self._kept: set[int] = set()
        self._age = 0  # commits since it was taken

    def commit(self, step: int, tensors: list[tuple[str, torch.Tensor]], asked: int) -> None:
        """The donor commits the step after `step`, whose `tensors` a heal asked for up to
        index `asked` (-1: no heal asked since the last commit)."""
        self._age += 1
        if asked >= 0 and step >= 0:
            import torch

            empty = torch.empty(0)
            self.step, self._age = step, 0
            self._kept = set(range(asked, len(tensors)))
            self._tensors = [
                (key, tensor.detach().clone() if index in self._kept else empty)
                for index, (key, tensor) in enumerate(tensors)
            ]
        elif self._age >= OLD_STEP_COMMITS:
            self.step, self._tensors, self._kept = -1, [], set()

    def serve(self, pieces: Sequence[Piece], refusal: str) -> list[Chunk]:
        """The bytes of `pieces` at the old step; `refusal` if any was not kept."""
        if not all(isinstance(p, tuple) and p and p[0] in self._kept for p in pieces):
            raise RuntimeError(refusal)
        return serve(self._tensors, pieces)


def _refusal(step: int, committed: int) -> str:
    return (
        f"asked for the state of step {step} but this replica has committed {committed}: "
        "heal again from the current step"
    )


@dataclass(frozen=True)
class StepStart:
    """What a replica's step began with and may change before it is committed or dropped:
    copies of the model's buffers, and the data position and RNG states."""

    buffers: list[torch.Tensor]
    position: Position


# -- the receiver's side ---------------------------------------------------------------------


class _Donor(Protocol):
    """The two endpoints of a `Replica` that a heal calls."""

    def layout(self) -> Future[StateLayout]: ...

    def chunks(self, step: int, pieces: Sequence[Piece]) -> Future[list[Chunk]]: ...


def endpoints_of(actors: ActorMesh[Any]) -> _Donor:
    """A one-rank replica mesh as a heal donor."""
    return _MeshDonor(actors)


class _MeshDonor:
    def __init__(self, actors: ActorMesh[Any]) -> None:
        self._actors = actors

    def layout(self) -> Future[StateLayout]:
        return self._actors.heal_layout.call_one()  # type: ignore[no-any-return]

    def chunks(self, step: int, pieces: Sequence[Piece]) -> Future[list[Chunk]]:
        return self._actors.heal_chunks.call_one(step, pieces)  # type: ignore[no-any-return]


_LOST = (SupervisionError, TimeoutError)


def heal(
    replica: HealingReplica,
    donors: Sequence[_Donor],
    chunk_bytes: int,
    window: int,
    timeout_s: float,
) -> HealReport:
    """Make `replica` hold the committed state of `donors` (live replicas, identical state):
    tensors, optimizer state, data position and RNG states."""
    if not donors:
        raise ValueError("a heal needs at least one live peer to take the state from")
    if window < 1:
        raise ValueError(f"a heal needs a window of at least 1 request, not {window}")
    started = time.monotonic()
    lost: set[int] = set()
    layout = _first_layout(donors, lost, timeout_s)
    stream = _Stream(donors, plan_chunks(layout.tensors, chunk_bytes), layout.step, lost)
    targets = Targets(layout, replica.model, replica.optimizer)
    try:
        stream.run(targets, window, timeout_s)
    finally:
        targets.close()
    targets.finish(replica.optimizer)
    restore_position(replica, layout.position)
    replica.committed_step = layout.step
    return HealReport(
        step=layout.step,
        nbytes=layout.nbytes,
        seconds=time.monotonic() - started,
        chunks_per_donor=tuple(stream.served),
        lost_donors=tuple(sorted(lost)),
        allocated_bytes=targets.allocated_bytes,
    )


def _first_layout(donors: Sequence[_Donor], lost: set[int], timeout_s: float) -> StateLayout:
    errors = []
    for index, donor in enumerate(donors):
        try:
            return donor.layout().get(timeout=timeout_s)
        except _LOST as exc:
            lost.add(index)
            errors.append(f"peer {index}: {type(exc).__name__}: {exc}")
    raise RuntimeError("no peer could describe its state: " + "; ".join(errors))


class _Stream:
    """The chunk requests of one heal: who sends what, what is in flight, what is left."""

    def __init__(
        self, donors: Sequence[_Donor], chunks: list[tuple[Piece, ...]], step: int, lost: set[int]
    ) -> None:
        self.donors = donors
        self.chunks = chunks
        self.step = step
        self.lost = lost
        self.served = [0] * len(donors)
        self.pending: deque[int] = deque(range(len(chunks)))
        self.in_flight: deque[tuple[int, int, Future[list[Chunk]]]] = deque()
        self.load = [0] * len(donors)

    def run(self, targets: Targets, window: int, timeout_s: float) -> None:
        self._fill(window)
        while self.in_flight:
            donor, chunk, future = self.in_flight.popleft()
            self.load[donor] -= 1
            try:
                reply = future.get(timeout=timeout_s)
            except _LOST:
                self._lose(donor, chunk)
            else:
                targets.write(self.chunks[chunk], reply)
                self.served[donor] += 1
            self._fill(window)
        if self.pending:
            raise RuntimeError(
                f"every peer died or went silent during the heal, {len(self.pending)} of "
                f"{len(self.chunks)} chunks were left to fetch"
            )

    def _fill(self, window: int) -> None:
        """Give pending chunks to live donors with room, round robin."""
        while self.pending:
            open_donors = [
                d for d in range(len(self.donors)) if d not in self.lost and self.load[d] < window
            ]
            if not open_donors:
                return
            for donor in open_donors:
                if not self.pending:
                    return
                chunk = self.pending.popleft()
                future = self.donors[donor].chunks(self.step, self.chunks[chunk])
                self.in_flight.append((donor, chunk, future))
                self.load[donor] += 1

    def _lose(self, donor: int, chunk: int) -> None:
        """`donor` is gone: its chunks in flight go back to the front of the queue."""
        self.lost.add(donor)
        again = [chunk] + [c for d, c, _ in self.in_flight if d == donor]
        self.in_flight = deque(entry for entry in self.in_flight if entry[0] != donor)
        self.load[donor] = 0
        self.pending.extendleft(reversed(again))
