"""A spare's updates fetched ahead of applying them.

A peer keeps only its last `Replica.standby_updates` committed updates. A spare applies them at
a low priority (`_follow.Lowered`), which on a busy machine can take several steps; if it fetched
them only then, its peers would have dropped the first ones it lacks, and it would be healed
whole. So a `follow` fetches the updates it is asked for at once, at its thread's own priority
(a short exchange of messages, the bytes lent by the peer), and applies them after, in order,
at the low priority; a later `follow` fetches beside an earlier one still applying, and a
take-over applies what was fetched without fetching it again.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._arithmetic import apply_average, digest
from ._follow import Takeover, fetch_updates, peer_position, rank_match
from ._position import restore_position

if TYPE_CHECKING:
    import torch

    from mesh import ActorMesh


class Prefetched:
    """The committed updates a spare fetched and has not applied yet, by step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards `_updates` and `_through`
        self._fetching = threading.Lock()  # one fetch at a time: each asks for what follows
        self._updates: dict[int, torch.Tensor] = {}
        self._through = 0  # the last step fetched

    def fetch(self, replica: Any, step: int, ranks: Sequence[ActorMesh[Any]]) -> None:
        """Fetch the updates after those `replica` (a `Replica`) holds or fetched, up to
        committed `step`, each from the first of `ranks` (a peer's rank each) that keeps it, in
        a message of its own (at 1 GB, a few updates together exceed the transport's largest
        message). One not fetched (no peer keeps it) leaves the replica behind: it is healed."""
        with self._fetching:
            with self._lock:
                first = max(replica.committed_step, self._through) + 1
            numel = sum(p.numel() for p in replica.model.parameters())
            for wanted in range(first, step + 1):  # one a message: several may exceed its limit
                updates = fetch_updates(ranks, wanted, wanted, numel, replica.heal_timeout_s)
                if not updates:
                    return
                with self._lock:
                    self._updates[wanted], self._through = updates[0], wanted

    def take(self, step: int) -> torch.Tensor | None:
        """The update of `step`, no longer held here; those of earlier steps are dropped (the
        replica holds them already, through a heal)."""
        with self._lock:
            for old in [held for held in self._updates if held < step]:
                del self._updates[old]
            return self._updates.pop(step, None)


def apply_fetched(replica: Any, step: int) -> int:
    """Apply the fetched updates that follow `replica`'s committed step, up to `step`, in
    order (the caller holds the replica's `Lowered`); returns how many."""
    applied = 0
    if replica.committed_step < step:
        with replica._changing:
            replica._donor.clear()
    while replica.committed_step < step:
        update = replica._prefetched.take(replica.committed_step + 1)
        if update is None:
            break
        apply_average(replica.model, replica.optimizer, update)
        replica.committed_step += 1
        replica._updates.record(replica.committed_step, update)
        applied += 1
    return applied


def follow_group(
    replica: Any, step: int, ranks: Sequence[ActorMesh[Any]], check: bool
) -> tuple[int, str]:
    """A spare (`replica`) reaches committed `step`: fetches the updates it lacks at once,
    applies them at a low priority (at its own if it lags more than `standby_follow_every`
    steps, which also raises an earlier follow still applying), and returns the step it holds
    and, if `check`, its digest ("" if not, or if the spare took a place meanwhile)."""
    replica._prefetched.fetch(replica, step, ranks)
    lags = step - replica.committed_step > replica.standby_follow_every
    if lags:
        replica._lowered.hurry()
    with replica._lowered.following(lower=not lags):
        if replica.replica_id != -1:  # it took a place meanwhile: it follows no more
            return replica.committed_step, ""
        replica.on_phase("follow", step)
        apply_fetched(replica, step)
        check = check and not replica._lowered.awaited  # (the take-over checks its step)
        return replica.committed_step, digest(replica.model) if check else ""


def catch_up(replica: Any, step: int, ranks: Sequence[ActorMesh[Any]]) -> int:
    """Apply the committed updates after `replica`'s step up to `step`: those fetched by a
    follow, then the rest from the first of `ranks` (a peer's rank each) that keeps them;
    returns how many."""
    replica._prefetched.fetch(replica, step, ranks)
    return apply_fetched(replica, step)


def take_over(
    replica: Any, step: int, expected: str | None, peers: Sequence[ActorMesh[Any]], rank: int
) -> Takeover:
    """A spare (`replica`, of `rank`) catches up to committed `step` from `peers`' updates and
    takes their data position and RNG states; it heals its whole state from them instead if
    it cannot, or if its parameters do not match `expected` (the digest of `step`; None:
    already checked)."""
    ranks = [rank_match(peer, rank) for peer in peers]
    asked = ranks[0].heal_layout.call_one() if ranks else None  # beside the catch-up
    applied = catch_up(replica, step, ranks)
    position = peer_position(ranks, step, replica.heal_timeout_s, asked)
    matches = expected is None or digest(replica.model) == expected
    if replica.committed_step == step and matches and position is not None:
        restore_position(replica, position)
        return Takeover(step, applied, healed=False)
    replica._heal(list(peers))
    return Takeover(replica.committed_step, applied, healed=True)
