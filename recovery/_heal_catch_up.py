"""A replacement's catch-up on the steps its group committed while it healed (actor side).

A heal takes the state of the step it began at; the survivors go on committing meanwhile. So
as soon as its heal ends, a replacement (`Replica.rejoin`) applies the averaged gradients of
the steps committed since, which the members keep while a replacement is on its way, and
takes a member's data position and RNG states of the step it reaches. It does this beside
the group's steps, not between two of them where the whole group would wait. The group
checks the digest it reports against its own digest of that step before letting it in
(`_rejoin`): state that changes outside the updates (buffers a forward pass updates, a
schedule) cannot be caught up with them, and such a replacement heals whole.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from supervision import ActorError, SupervisionError

from ._arithmetic import digest
from ._follow import rank_match
from ._heal import HealReport
from ._heal_state import StateLayout
from ._position import restore_position
from ._prefetch import catch_up

if TYPE_CHECKING:
    from mesh import ActorMesh

#: Rounds of catch-up at most: each asks a member for its committed step and applies the
#: updates up to it. A round takes a share of a step, so the group commits once or twice
#: during the whole catch-up at most; the group catches up the rest between two steps.
CATCH_UP_ROUNDS = 3
#: A replacement this many committed steps behind heals again, from the newest committed step,
#: instead of applying the updates. At 1 GB on 2 cores, an update applied cost the replacement
#: 0.5 to 0.85 s of CPU (an Adam step, and 336 MB fetched) and the heal of the whole 1 GB 0.7 s
#: (page faults included, which a second heal no longer takes); the donors send 1 GB instead
#: of 336 MB per update. So one update behind is applied, two or more heal again.
HEAL_AGAIN_BEHIND = 2


def caught_up(
    replica: Any, report: HealReport, peers: Sequence[ActorMesh[Any]], rank: int
) -> HealReport:
    """`report` of the heal of `replica` (a `Replica`, of `rank`), once `replica` has applied
    the updates its `peers` (live replicas) committed since the heal's step; the same report
    if there were none, or if no peer keeps them any more (the group catches it up or heals
    it again). The data position and RNG states are those of the step reached; the report's
    `seconds` count the catch-up too. Two or more steps behind, it heals again instead
    (`HEAL_AGAIN_BEHIND`), and the report is that heal's."""
    started, first_seconds = time.monotonic(), report.seconds
    ranks = [rank_match(peer, rank) for peer in peers]
    applied, positioned = 0, report.step  # the step whose data position it holds
    for _ in range(CATCH_UP_ROUNDS):
        layout = _committed_layout(ranks, replica.heal_timeout_s)
        if layout is None or layout.step <= replica.committed_step:
            break
        if layout.step - replica.committed_step >= HEAL_AGAIN_BEHIND:  # cheaper than updates
            report = replica._heal(list(peers))  # into memory present now: no page faults
            applied, positioned = 0, report.step
            continue
        applied += catch_up(replica, layout.step, ranks)
        if replica.committed_step != layout.step:  # an update was not kept: stop here
            break
        restore_position(replica, layout.position)
        positioned = layout.step
    seconds = first_seconds + time.monotonic() - started
    if not applied:
        return dataclasses.replace(report, seconds=seconds)
    # short of a round's step, its data position is an older step's: no digest, and the
    # group catches it up between two steps (`take_place`)
    held = digest(replica.model) if positioned == replica.committed_step else ""
    return dataclasses.replace(
        report, step=replica.committed_step, seconds=seconds, updates=applied, digest=held
    )


def _committed_layout(ranks: Sequence[ActorMesh[Any]], timeout_s: float) -> StateLayout | None:
    """The layout (committed step, data position, RNG states) of the first of `ranks` (a
    member's rank each) that answers; None if none does."""
    for peer in ranks:
        try:
            layout = peer.heal_layout.call_one().get(timeout=timeout_s)
        except (SupervisionError, ActorError, TimeoutError):
            continue
        if isinstance(layout, StateLayout):
            return layout
    return None
