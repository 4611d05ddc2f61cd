"""How a failed member of a `ReplicaGroup` comes back without the others waiting for it.

A ready spare takes its place at once (`_standby`). Otherwise the member is re-spawned in the
background; as soon as it runs (`Replica.rejoin`), it heals from the live replicas *while they
step* (a replica serves the committed state during its own step: the step changes it only
when it is committed). A heal that a commit overtakes goes on at the newest step and replays
the update on what it fetched before (`_heal_groups`). A heal that ended at step h, when the
group has committed c > h since, is finished by applying the averaged gradients of steps
h+1..c, which the members keep while a replacement is on its way (`KEEP_WHILE_HEALING`): the
replacement does it itself as its heal ends, and what a commit made meanwhile leaves is caught
up beside the next step too (`take_place`, not waited for). The member then joins the step in
flight (`_inflight`) or takes part from the next step on.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from mesh import Future
from supervision import ActorError, SupervisionError
from transport import get_logger

from ._heal import HealReport
from ._members import Member, ReplicaSpawner
from ._outcomes import short
from ._standby import Standbys

#: While a replacement heals, members keep the averaged gradients of this many committed steps
#: (a gradient's memory each): a heal that commits overtook replays them on what it fetched
#: before (`_heal_groups`), and a heal that ended a step behind is caught up with them.
KEEP_WHILE_HEALING = 2

_LOST = (SupervisionError, ActorError, TimeoutError)


class Rejoins:
    """Brings the group's failed members back; `tend` between two steps does the next move of
    each, never waiting for a spawn or a heal."""

    def __init__(
        self,
        members: list[Member],
        spawner: ReplicaSpawner,
        standbys: Standbys,
        configure_args: Callable[[Member], tuple[int, int, int]],
        timeout_s: float,
        name: str,
    ) -> None:
        self._members = members
        self._spawner = spawner
        self._standbys = standbys
        self._configure_args = configure_args
        self._timeout_s = timeout_s
        self._log = get_logger("recovery.group", group=name)
        #: catch-ups under way beside the steps (`take_place`), by member: the step they
        #: catch up to and the call
        self._catching: dict[int, tuple[int, Future[Any]]] = {}

    def under_way(self) -> bool:
        """Whether a member is on its way back (the members keep updates for it)."""
        return any(m.state != "live" for m in self._members)

    def tend(self, committed: int) -> bool:
        """One move for each failed member, the group having committed `committed` steps.
        True if a spare took a member's place (same ids, other procs: a fresh group)."""
        replaced = False
        for member in self._members:
            with member.lock:  # `respawn` may be under way on the event loop thread
                state, respawn, up, healing = (
                    member.state,
                    member.respawn,
                    member.up,
                    member.healing,
                )
            if state != "failed":
                continue
            if member.index in self._catching:
                self._caught(member, committed)
            elif respawn is None:
                if self._take_spare(member, committed):
                    replaced = True
                else:
                    self.respawn(member)
            elif up is not None:
                if up.done():
                    self._up(member, committed)
            elif healing is None:  # up, but there was no one to heal from: try again
                self._heal(member, committed)
            elif healing.done():
                self._healed(member, committed)
        return replaced

    def joinable(self, committed: int) -> list[int]:
        """The failed members whose replacement holds committed step `committed`, checked
        (healed, caught up, with the group's digest): they may join the step in flight
        (`_inflight`); `joined` makes them live. A replacement whose heal ended behind
        starts its catch-up now, beside the step (`_catch_up_beside`), not at the next
        step boundary: it may still join this step once caught up."""
        found = []
        for member in self._members:
            with member.lock:
                state, up, healing = member.state, member.up, member.healing
            if state != "failed" or up is not None or healing is None or not healing.done():
                continue
            if healing.exception() is None:
                reports = list(healing.get().values())
                if all(r.step == committed for r in reports) and self._checked(reports, committed):
                    found.append(member.index)
                elif self._catch_up_beside(member, committed):
                    with member.lock:
                        member.healing = None
        return found + [
            i for i, (step, take) in self._catching.items() if _holds(take, step, committed)
        ]

    def joined(self, member: Member) -> None:
        """`member`'s replacement joins the step in flight (it was `joinable`)."""
        assert member.recovery is not None
        member.healing, member.recovery.in_flight = None, True
        self._catching.pop(member.index, None)
        self._live(member)

    def respawn(self, member: Member) -> None:
        """Re-spawn failed `member` in the background (on a spare host if its host is lost).
        Any thread: the group calls it as soon as it hears of the failure, from the event
        loop thread too (never waits: it only sends). Its fields change together, under the
        member's lock, so that `tend` never sees a re-spawn without its first call."""
        with member.lock:
            if member.respawn is not None or member.state != "failed":
                return
            host = self._spawner.spare_hosts.take() if member.host_lost else None
            member.host_lost = False
            respawn = member.procs.respawn(on=host)
            # calls to a re-spawning rank wait for it: this one starts as soon as it is up
            donors, args = self._donors(), self._configure_args(member)
            if donors:  # it heals as soon as it runs, not at the next step boundary
                member.healing = _timed(member.actors.rejoin.call(*args, donors), member)
            else:
                member.up = member.actors.configure.call(*args)
            member.respawn = respawn

    def _take_spare(self, member: Member, committed: int) -> bool:
        donors = self._donors()
        return bool(donors) and self._standbys.replace(member, committed, donors)

    def _up(self, member: Member, committed: int) -> None:
        up, member.up = member.up, None
        assert up is not None and member.recovery is not None
        error = up.exception()
        if error is not None:  # failed again: the next tend re-spawns it
            self._log.warning("replica_respawn_failed", replica=member.index, reason=short(error))
            member.respawn = None
            return
        member.recovery.respawned_at = time.monotonic()
        self._heal(member, committed)

    def _heal(self, member: Member, committed: int) -> None:
        """Start a heal of `member` from every live replica (not waited for)."""
        donors = self._donors()
        if not donors and not committed:  # nothing committed yet: as built, it is current
            self._live(member)
        elif donors:
            member.healing = _timed(member.actors.heal_from.call(donors), member)

    def _healed(self, member: Member, committed: int) -> None:
        healing, member.healing = member.healing, None
        assert healing is not None
        error = healing.exception()
        if isinstance(error, SupervisionError):  # the replacement itself failed: re-spawn
            member.respawn = None
            return
        if error is not None:  # a commit overtook it, or a donor failed: heal again
            self._log.info("replica_heal_again", replica=member.index, reason=short(error))
            self._heal(member, committed)
            return
        reports = list(healing.get().values())
        step = min(report.step for report in reports)
        if step == committed and self._checked(reports, committed):
            self._live(member)
        elif self._catch_up_beside(member, committed):
            return  # it may join a step in flight once caught up (`joinable`)
        elif self._catch_up(member, committed):
            self._live(member)
        else:
            self._heal(member, committed)

    def _catch_up_beside(self, member: Member, committed: int) -> bool:
        """Start `member`'s catch-up to committed step `committed` (`take_place`: the updates
        it lacks, checked against the group's digest, or a whole heal if that differs) while
        the group steps on, instead of between two steps where the whole group would wait:
        done, it joins the step in flight (`joinable`) or the next one. False (nothing
        started) without the group's digest of that step or a live peer."""
        donors, expected = self._donors(), self._standbys.digest_of(committed)
        if not donors or expected is None:
            return False
        take = member.actors.take_place.call(member.index, committed, expected, donors)
        self._catching[member.index] = (committed, take)
        return True

    def _caught(self, member: Member, committed: int) -> None:
        """The next move of `member`, whose catch-up beside the steps (`_catch_up_beside`)
        is under way: none until it ends; then live if it holds committed step `committed`,
        another catch-up if the group committed meanwhile, a re-spawn if it failed."""
        _, catching = self._catching[member.index]
        if not catching.done():
            return
        del self._catching[member.index]
        error = catching.exception()
        if isinstance(error, SupervisionError):  # the replacement itself failed: re-spawn
            member.respawn = None
        elif error is not None:
            self._log.info("replica_heal_again", replica=member.index, reason=short(error))
            self._heal(member, committed)
        elif all(done.step == committed for done in catching.get().values()):
            self._live(member)
        elif not self._catch_up_beside(member, committed):
            self._heal(member, committed)

    def _checked(self, reports: list[HealReport], committed: int) -> bool:
        """Whether `reports` (of a heal that reached committed step `committed`) hold its
        state: a heal alone takes it whole; a heal followed by a catch-up on updates
        (`_heal_catch_up`) must show the group's digest of that step."""
        expected = self._standbys.digest_of(committed) or "unknown"
        return all(not report.updates or report.digest == expected for report in reports)

    def _catch_up(self, member: Member, committed: int) -> bool:
        """Apply the committed updates `member` lacks, from a live peer (between two steps).
        Its parameters are then checked against the group's digest of `committed` (taken as
        it committed, while a replacement is on its way): state that changes outside the
        updates (buffers a forward pass updates) makes it heal whole instead, in the same
        call. Without that digest, a peer hashes its parameters while the member catches up."""
        donors = self._donors()
        if not donors:
            return False
        expected = self._standbys.digest_of(committed)
        theirs = donors[0].status.call() if expected is None else None
        take = member.actors.take_place.call(member.index, committed, expected, donors)
        try:
            done = list(take.get(timeout=self._timeout_s).values())
            if any(takeover.step != committed for takeover in done):
                return False
            if any(takeover.healed for takeover in done) or theirs is None:
                self._log.info("replica_caught_up", replica=member.index, how=done)
                return True  # `take_place` checked it (healed it whole if it differed)
            mine = list(member.actors.status.call().get(timeout=self._timeout_s).values())
            expected = _digest_of(theirs, donors[1:], committed, self._timeout_s)
            if all(held == (committed, expected) for held in mine):
                return True
            self._log.info("replica_catch_up_diverged", replica=member.index, step=committed)
            healed = member.actors.heal_from.call(donors).get(timeout=self._timeout_s)
        except _LOST as exc:
            self._log.warning("replica_catch_up_failed", replica=member.index, reason=short(exc))
            return False
        return all(report.step == committed for report in healed.values())

    def _live(self, member: Member) -> None:
        assert member.recovery is not None
        member.recovery.healed_at = time.monotonic()
        with member.lock:
            member.state, member.respawn = "live", None
        self._log.info("replica_healed", replica=member.index)

    def _donors(self) -> list[Any]:
        return [m.actors for m in self._members if m.state == "live"]


def _digest_of(first: Future[Any], others: list[Any], committed: int, timeout_s: float) -> str:
    """The parameter digest of committed step `committed`: from the first donor's `status`
    reply (`first`), else from the first of `others` that answers holding it; "unknown" (no
    replica holds it: the check fails, and the replacement heals whole) if none does."""
    for reply in itertools.chain([first], (other.status.call() for other in others)):
        try:
            held = reply.get(timeout=timeout_s)
        except _LOST:
            continue
        found = {entry for entry in held.values() if entry[0] == committed}
        if len(found) == 1:
            return str(found.pop()[1])
    return "unknown"


def _holds(take: Future[Any], step: int, committed: int) -> bool:
    """Whether catch-up `take` (to committed step `step`) ended well, at step `committed`."""
    if step != committed or not take.done() or take.exception() is not None:
        return False
    return all(done.step == committed for done in take.get().values())


def _timed(healing: Future[Any], member: Member) -> Future[Any]:
    """`healing` (a heal of `member`'s replacement), which notes when it began once it ends
    well: the replacement was up (spawned, built) then. Noted as it ends, on whichever thread
    settles it, not at the step boundary where the group sees it."""
    recovery = member.recovery

    def note(done: Future[Any]) -> None:
        if recovery is not None and recovery.respawned_at is None and done.exception() is None:
            seconds = max(report.seconds for report in done.get(timeout=0).values())
            recovery.respawned_at = time.monotonic() - seconds

    healing.add_done_callback(note)
    return healing
