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

from ._members import Member, failures
from ._outcomes import ReplicaLost, short
from ._spares import host_lost
from ._standby import Standbys


@dataclass(frozen=True, eq=False)
class InFlight:
    """The group's side of completing a step in flight (see the module docstring); the
    callables are the group's own: mark a member failed, form the step's process group, call
    an endpoint on members, the current quorum; `name` is the group's, for its log."""

    members: list[Member]
    standbys: Standbys
    failed: Callable[[int, str, bool], None]
    form_group: Callable[[tuple[int, ...], int], bool]
    call_all: Callable[..., dict[int, Any]]
    quorum: Callable[[], int]
    name: str

    def possible(self, members: tuple[int, ...]) -> Callable[[Mapping[int, Any]], bool] | None:
        """Whether spares could complete the step of `members` now, given the prepare calls
        `done` so far: a member died, and a spare is ready for each one that did (the step's
        prepare stops waiting then); None in a group without spares."""

        def now(done: Mapping[int, Any]) -> bool:
            dead = sum(
                self.members[i].state == "failed" or isinstance(done.get(i), SupervisionError)
                for i in members
            )
            return 0 < dead <= self.standbys.ready()

        return now if self.standbys.meshes else None

    def complete(
        self, members: tuple[int, ...], step: int, world: int, prepared: Mapping[int, Any]
    ) -> dict[int, BaseException]:
        """The failures left of `members`' prepare of `step` (`prepared`: each one's values or
        error; a member left out is still in its call): none if every one succeeded, or if
        spares completed the step in place of the dead; otherwise the failures that discard
        it (a survivor still in its prepare is not among them: it is aborted)."""
        failed = failures(prepared) | {
            i: ReplicaLost(f"replica {i} failed during this step")
            for i in members
            if i not in prepared and self.members[i].state != "live"
        }
        dead = self._dead(failed)
        if not dead or len(dead) > self.standbys.ready():
            return failed
        for index in dead:
            self.failed(index, short(failed[index]), host_lost(failed[index]))
        survivors = [self.members[i].actors for i in members if i not in dead]
        replaced = []
        for index in dead:
            if not self.standbys.replace(self.members[index], step - 1, survivors):
                break
            replaced.append(index)
        if len(replaced) == len(dead) and self.form_group(members, step):
            quorum = self.quorum()  # the spares' gradients first, then everyone's exchange
            left = failures(self.call_all(tuple(dead), "prepare", step, quorum, world, False))
            if left:
                return left  # a spare failed: the survivors are aborted
            left = failures(self.call_all(members, "prepare", step, quorum, world))
            log = get_logger("recovery.group", group=self.name)
            log.info("step_in_flight_completed", step=step, by_spares=dead, failed=sorted(left))
            return left
        why = RuntimeError("a spare took its place, but the step could not be completed")
        gone = {i: e for i, e in failed.items() if i not in replaced}  # a spare's place is live
        return gone | {index: why for index in replaced}  # (not aborted: nothing under way)

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
