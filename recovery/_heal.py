"""Healing: a replacement pulls the committed state of live peers in chunks, several at once.

The receiver asks one donor for the layout of its state (`_heal_state.StateLayout`), plans
fixed-size chunks over the tensors' bytes and keeps up to `window` chunk requests in flight
per donor; whichever donor has room takes the next chunk, so the donors send disjoint subsets
and a faster one sends more. Each reply is copied into the preallocated tensors and dropped:
the extra memory on either side is the chunks in flight, not a copy of the state. A donor that
dies (or does not answer within `timeout_s`) loses its chunks to the others; the heal fails
only when no donor is left. Every request names the committed step, and a donor answers one
for any other step with `Stale`; once no donor holds the heal's step, the heal goes on at the
newest one and replays the updates on what it fetched before (`_heal_groups`), so a heal never
mixes two states.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from supervision import SupervisionError

from ._arithmetic import digest
from ._heal_donor import HealingReplica, Stale
from ._heal_groups import FetchUpdate, TensorGroups, replay
from ._heal_state import Chunk, Piece, StateLayout, Targets, plan_chunks
from ._position import restore_position

if TYPE_CHECKING:
    import torch

    from mesh import ActorMesh, Future

#: A heal goes on at a newer committed step this many times at most when no donor holds the
#: step it was at any more (each part writes into the memory of the last).
HEAL_STARTS = 3
#: What a heal fetched at a step at most this many steps older than the newest is brought
#: forward by replaying the committed updates on it (an optimizer step on that part, and an
#: update fetched per step); older, it is fetched again (`_heal_groups`).
REPLAY_BEHIND = 1


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
    starts: int = 1  # the committed steps it fetched at (commits overtook it: 2 or more)

    @property
    def gigabytes_per_second(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


# -- the receiver's side ---------------------------------------------------------------------


class _Donor(Protocol):
    """The two endpoints of a `Replica` that a heal calls."""

    def layout(self) -> Future[StateLayout]: ...

    def chunks(self, step: int, pieces: Sequence[Piece]) -> Future[list[Chunk] | Stale]: ...


def endpoints_of(actors: ActorMesh[Any]) -> _Donor:
    """A one-rank replica mesh as a heal donor."""
    return _MeshDonor(actors)


class _MeshDonor:
    def __init__(self, actors: ActorMesh[Any]) -> None:
        self._actors = actors

    def layout(self) -> Future[StateLayout]:
        return self._actors.heal_layout.call_one()  # type: ignore[no-any-return]

    def chunks(self, step: int, pieces: Sequence[Piece]) -> Future[list[Chunk] | Stale]:
        return self._actors.heal_chunks.call_one(step, pieces)  # type: ignore[no-any-return]


_LOST = (SupervisionError, TimeoutError)


class _Overtaken(Exception):
    """No donor left holds the step the heal is at: go on at the newest one."""


def heal(
    replica: HealingReplica,
    donors: Sequence[_Donor],
    chunk_bytes: int,
    window: int,
    timeout_s: float,
    fetch_update: FetchUpdate | None = None,
) -> HealReport:
    """Make `replica` hold the committed state of `donors` (live replicas, identical state):
    tensors, optimizer state, data position and RNG states. If the donors commit past the
    heal's step, it fetches the rest at the newest step and replays the committed updates
    (`fetch_update`) on the parameters it fetched before (`_heal_groups`); without them, or
    more than `REPLAY_BEHIND` steps behind, it fetches those again."""
    if not donors:
        raise ValueError("a heal needs at least one live peer to take the state from")
    if window < 1:
        raise ValueError(f"a heal needs a window of at least 1 request, not {window}")
    started, lost = time.monotonic(), set[int]()
    layout = _first_layout(donors, lost, timeout_s)
    groups = TensorGroups(layout.tensors, replica.model, replica.optimizer)
    todo, at, older = groups.order, dict[int, int](), dict[str, int]()
    memory: dict[str, torch.Tensor] = {}
    behind = REPLAY_BEHIND if fetch_update is not None else 0
    for start in range(HEAL_STARTS):
        stream = _Stream(donors, plan_chunks(layout.tensors, chunk_bytes, todo), layout, lost)
        targets = Targets(layout, replica.model, replica.optimizer, memory)
        try:
            stream.run(targets, window, timeout_s)
            break
        except _Overtaken:
            memory = targets.by_key()  # written again, or kept: no new memory
            at.update(dict.fromkeys(stream.whole(todo), layout.step))
            if start == HEAL_STARTS - 1:
                raise RuntimeError(
                    f"the peers committed a step during each of {HEAL_STARTS} parts of a heal: "
                    "heal again"
                ) from None
            layout = _first_layout(donors, lost, timeout_s)
            todo, older = groups.kept(at, layout.step, behind)
        finally:
            targets.close()
    targets.finish(replica.optimizer)
    replayed = replay(replica.model, replica.optimizer, older, layout.step, fetch_update)
    if replayed < 0:  # an update is no longer kept: the whole state, into this memory
        return heal(replica, donors, chunk_bytes, window, timeout_s)
    restore_position(replica, layout.position)
    replica.committed_step = layout.step
    return HealReport(
        step=layout.step,
        nbytes=layout.nbytes,
        seconds=time.monotonic() - started,
        chunks_per_donor=tuple(stream.served),
        lost_donors=tuple(sorted(lost)),
        allocated_bytes=targets.allocated_bytes,
        updates=replayed,
        digest=digest(replica.model) if replayed else "",
        starts=start + 1,
    )


def _first_layout(donors: Sequence[_Donor], lost: set[int], timeout_s: float) -> StateLayout:
    errors = []
    for index, donor in enumerate(donors):
        if index in lost:
            continue
        try:
            return donor.layout().get(timeout=timeout_s)
        except _LOST as exc:
            lost.add(index)
            errors.append(f"peer {index}: {type(exc).__name__}: {exc}")
    raise RuntimeError("no peer could describe its state: " + "; ".join(errors))


class _Stream:
    """The chunk requests of one heal: who sends what, what is in flight, what is left. A
    donor that answers `Stale` (it no longer holds the heal's step) sends no more of it."""

    def __init__(
        self,
        donors: Sequence[_Donor],
        chunks: list[tuple[Piece, ...]],
        layout: StateLayout,
        lost: set[int],
    ) -> None:
        self.donors = donors
        self.chunks = chunks
        self.specs = layout.tensors
        self.step = layout.step
        self.lost = lost
        self.stale: set[int] = set()
        self.fetched: dict[int, int] = {}  # bytes written, by tensor
        self.served = [0] * len(donors)
        self.pending: deque[int] = deque(range(len(chunks)))
        self.in_flight: deque[tuple[int, int, Future[list[Chunk] | Stale]]] = deque()
        self.load = [0] * len(donors)

    def run(self, targets: Targets, window: int, timeout_s: float) -> None:
        self._fill(window)
        while self.in_flight:
            donor, chunk, future = self.in_flight.popleft()
            self.load[donor] -= 1
            try:
                reply = future.get(timeout=timeout_s)
            except _LOST:
                self._drop(donor, chunk, self.lost)
            else:
                if isinstance(reply, Stale):
                    self._drop(donor, chunk, self.stale)
                else:
                    targets.write(self.chunks[chunk], reply)
                    self.served[donor] += 1
                    for index, first, end in self.chunks[chunk]:
                        self.fetched[index] = self.fetched.get(index, 0) + end - first
            self._fill(window)
        if self.pending and self.stale:
            raise _Overtaken()
        if self.pending:
            raise RuntimeError(
                f"every peer died or went silent during the heal, {len(self.pending)} of "
                f"{len(self.chunks)} chunks were left to fetch"
            )

    def _fill(self, window: int) -> None:
        """Give pending chunks to live donors with room, round robin."""
        while self.pending:
            open_donors = [
                d
                for d in range(len(self.donors))
                if d not in self.lost and d not in self.stale and self.load[d] < window
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

    def whole(self, tensors: Sequence[int]) -> list[int]:
        """Of `tensors`, those fetched whole."""
        return [i for i in tensors if self.fetched.get(i, 0) == self.specs[i].nbytes]

    def _drop(self, donor: int, chunk: int, why: set[int]) -> None:
        """`donor` sends no more (it is gone, or stale): its chunks in flight go back to the
        front of the queue."""
        why.add(donor)
        again = [chunk] + [c for d, c, _ in self.in_flight if d == donor]
        self.in_flight = deque(entry for entry in self.in_flight if entry[0] != donor)
        self.load[donor] = 0
        self.pending.extendleft(reversed(again))
