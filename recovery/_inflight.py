"""A step in flight completed by hot spares, instead of discarded (`ReplicaGroup(spares=K)`).

When participants of step s die during `prepare` (before the step is decided), each survivor
already holds its local gradient of step s: only the exchange failed (given up on the abort
notice, or reset by the dead peer). So as soon as the group hears of the death (without
waiting for the survivors to give their exchange up), a ready spare takes each dead
participant's place (`Standbys.replace`: it catches up to committed step s-1 and takes a
survivor's data position and RNG states as they were when step s began) and computes the dead
replica's gradient of s from the same batch, while the survivors finish theirs. Then every
participant prepares step s again in the group of the new members (a standing group, formed in
advance: no rendezvous): each holds its gradient already (`Replica.prepare` keeps the gradient
of an undecided step), so it only exchanges; no collective waits on a computation. The exchange
sums in replica order, so the average has the bits of a fault-free step s, which is committed
as usual.

A replacement joins the step in flight the same way (`InFlight.join`). When one holds the
committed state (healed, caught up, checked: `Rejoins.joinable`) while no participant failed
and some are still in their prepare, the group gives their exchange up (an abort notice),
forms a group with the replacement, which computes its gradient of the step, and every
participant exchanges again, each with the gradient it had. Its recovery then ends with that
step instead of the next one (at the cost of the exchange given up, and of the step waiting
for the replacement's gradient).

If that cannot be done, the step is discarded as before (`ReplicaGroup._abort`): fewer ready
spares than deaths, a failure that is not a death (a timeout: a replica may still be in its
step), a re-spawn already under way, or a death (a spare's, say) while the step is completed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from supervision import ActorError, SupervisionError
from transport import get_logger

from ._aborts import AbortNotices
from ._members import Member, failures
from ._outcomes import ReplicaLost, short
from ._rejoin import Rejoins
from ._spares import host_lost
from ._standby import Standbys


@dataclass(frozen=True, eq=False)
class InFlight:
    """The group's side of completing a step in flight (see the module docstring); the
    callables are the group's own: mark a member failed, form the step's process group, call
    an endpoint on members, the current quorum; `name` is the group's, for its log."""

    members: list[Member]
    standbys: Standbys
    rejoins: Rejoins
    notices: AbortNotices
    failed: Callable[[int, str, bool], None]
    form_group: Callable[[tuple[int, ...], int], bool]
    call_all: Callable[..., dict[int, Any]]
    quorum: Callable[[], int]
    name: str
    ranks: int  # per replica

    def possible(
        self, members: tuple[int, ...], step: int
    ) -> Callable[[Mapping[int, Any]], bool] | None:
        """Whether the step `step` of `members` could be completed with others now, given the
        prepare calls `done` so far (the step's prepare stops waiting then): a member died,
        and a spare is ready for each one that did; or no one failed and a replacement holds
        the committed state (`join`). None if neither can happen (no spares, no replacement)."""

        def now(done: Mapping[int, Any]) -> bool:
            dead = sum(
                self.members[i].state == "failed" or isinstance(done.get(i), SupervisionError)
                for i in members
            )
            if not dead and len(done) < len(members) and self.rejoins.under_way():
                return bool(self.rejoins.joinable(step - 1))
            return 0 < dead <= self.standbys.ready()

        return now if self.standbys.meshes or self.rejoins.under_way() else None

    def complete(
        self, members: tuple[int, ...], step: int, prepared: Mapping[int, Any]
    ) -> tuple[tuple[int, ...], dict[int, BaseException]]:
        """The members of `step` and the failures left of their prepare (`prepared`: each
        one's values or error; a member left out is still in its call): none if every one
        succeeded, if replacements joined, or if spares completed the step in place of the
        dead; otherwise the failures that discard it (a survivor still in its prepare is not
        among them: it is aborted)."""
        failed = failures(prepared) | {
            i: ReplicaLost(f"replica {i} failed during this step")
            for i in members
            if i not in prepared and self.members[i].state != "live"
        }
        joining = self.rejoins.joinable(step - 1) if len(prepared) < len(members) else []
        if joining and not failed:
            return self.join(members, step, joining)
        dead = self._dead(failed)
        if not dead or len(dead) > self.standbys.ready():
            return members, failed
        for index in dead:
            self.failed(index, short(failed[index]), host_lost(failed[index]))
        survivors = [self.members[i].actors for i in members if i not in dead]
        replaced = []
        for index in dead:
            if not self.standbys.replace(self.members[index], step - 1, survivors):
                break
            replaced.append(index)
        if len(replaced) == len(dead) and self.form_group(members, step):
            left = self._redo(members, step, tuple(dead))
            log = get_logger("recovery.group", group=self.name)
            log.info("step_in_flight_completed", step=step, by_spares=dead, failed=sorted(left))
            return members, left
        why = RuntimeError("a spare took its place, but the step could not be completed")
        gone = {i: e for i, e in failed.items() if i not in replaced}  # a spare's place is live
        return members, gone | {index: why for index in replaced}  # (not aborted: none under way)

    def join(
        self, members: tuple[int, ...], step: int, joining: list[int]
    ) -> tuple[tuple[int, ...], dict[int, BaseException]]:
        """Replacements `joining` take part in `step`, in flight: `members` give up their
        exchange (an abort notice; each keeps its gradient), and every one prepares the step
        again in a group with them (`_redo`). The replacements' recovery ends a step sooner."""
        self.notices.abort(self.quorum(), f"replicas {joining} join step {step}")
        for index in joining:
            self.rejoins.joined(self.members[index])
        everyone = tuple(sorted((*members, *joining)))
        if not self.form_group(everyone, step):
            why = RuntimeError(f"replicas {joining} joined, but the process group did not form")
            return everyone, {index: why for index in joining}  # discarded: tried again
        left = self._redo(everyone, step, tuple(joining))
        log = get_logger("recovery.group", group=self.name)
        log.info("step_in_flight_joined", step=step, replicas=joining, failed=sorted(left))
        return everyone, left

    def _redo(
        self, members: tuple[int, ...], step: int, new: tuple[int, ...]
    ) -> dict[int, BaseException]:
        """`step` prepared again by `members` in the group just formed: first the gradients
        of the `new` ones (the others keep theirs), then everyone's exchange."""
        quorum, world = self.quorum(), len(members) * self.ranks
        left = failures(self.call_all(new, "prepare", step, quorum, world, False))
        if left:
            return left  # a newcomer failed: the others are aborted
        return failures(self.call_all(members, "prepare", step, quorum, world))

    def _dead(self, failed: Mapping[int, BaseException]) -> list[int]:
        """The members of `failed` that died, if a spare can take each one's place in the step:
        every other failure must be a survivor's own error (its exchange was given up)."""
        dead = [i for i, e in failed.items() if isinstance(e, (SupervisionError, ReplicaLost))]
        others = [e for i, e in failed.items() if i not in dead]
        if any(not isinstance(error, ActorError) for error in others):
            return []
        if any(self.members[i].respawn is not None for i in dead):
            return []  # its replacement is on its way already
        return dead
