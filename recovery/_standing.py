"""Standing process groups of a `ReplicaGroup` with spares: the group of every take-over a
ready spare could make, formed before it is needed.

A spare that takes a failed replica's place would otherwise make the step it joins wait for a
fresh gloo rendezvous. So once every member is live and a spare is ready, each participant
forms, beside its steps, one process group per possible take-over: the members with replica
i's place held by the spare, for every i. The spare holds i's group ranks, so the exchange
sums in replica order as before (the replay's order: the bits do not change). When replica i
fails and the spare takes its place, the next step uses that group at once. A failure of any
other participant drops the groups it is in; the groups are formed again for the new members.
A formation that fails is marked aborted in the store: a participant still in it, or yet to
start it (its call queued behind another), gives it up at once instead of running it against
peers that left, one formation behind them from then on. The next try forms new groups; a
take-over meanwhile enters a fresh rendezvous.

No step waits for a formation: `ensure` sends the participants' calls (concurrent endpoints:
their steps go on beside them) and returns; a later look (`ensure`, `take`, `pending`) reads
their outcomes if they ended. Only a group that every participant reports formed is used; a
take-over before that enters a fresh rendezvous, as without standing groups. One formation
is under way at a time: the next one starts once its outcome is known.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mesh import ActorMesh, Future, ProcMesh
from transport import Addresses, get_logger

from ._aborts import AbortNotices, QuorumKeys
from ._exchange import GroupPlace
from ._members import gather
from ._outcomes import short

#: After a formation failed (a rendezvous timed out under load, say), the next try waits this.
RETRY_S = 1.0


@dataclass(frozen=True, eq=False)
class Standing:
    """A process group formed for the step after a take-over: `procs` in group rank order."""

    quorum: int
    procs: tuple[ProcMesh, ...]


@dataclass(frozen=True, eq=False)
class _Formation:
    """A formation under way: its groups, each participant's `stand_by` call, and when it
    counts as failed if a call has not ended."""

    groups: tuple[Standing, ...]
    calls: dict[ProcMesh, Future[Any]]
    deadline: float


class StandingGroups:
    """The controller's side: which standing groups exist, forming new ones, dropping those a
    failed participant was in (see the module docstring)."""

    def __init__(
        self,
        store: Addresses,
        notices: AbortNotices,
        ranks_per_replica: int,
        timeout_s: float,
        next_quorum: Callable[[], int],
        name: str,
    ) -> None:
        self._store = store
        self._notices = notices
        self._keys = QuorumKeys(notices)  # a quorum's keys go once no one needs them
        self._ranks = ranks_per_replica
        self._timeout_s = timeout_s
        self._next_quorum = next_quorum
        self._lock = threading.Lock()
        self._formed: list[Standing] = []
        self._forming: list[Standing] = []  # of the formation under way, less those broken
        self._formation: _Formation | None = None
        self._tried: set[tuple[ProcMesh, ...]] = set()  # formed or being formed
        self._wanted: set[tuple[ProcMesh, ...]] = set()  # the groups the last `ensure` wanted
        self._retry_at = 0.0
        self._log = get_logger("recovery.standing", group=name)

    def take(self, procs: Sequence[ProcMesh]) -> int | None:
        """The quorum of the standing group of exactly `procs` (in order), or None (also while
        that group is being formed): the step then forms a group of its own (`give_up`)."""
        self._settle()
        with self._lock:
            for standing in self._formed:
                if standing.procs == tuple(procs):
                    self._formed.remove(standing)
                    return standing.quorum
        self.give_up()
        return None

    def formed(self, quorum: int, left: int | None = None) -> None:
        """The group of `quorum` formed (a standing one taken, or a step's own): the store keys
        of the older quorums that no standing group uses go (`QuorumKeys`). A standing group
        is taken before its members leave the group of the step before, `left`: a step in
        flight that a spare completes still waits in it for its abort notice, so its keys stay
        until the next group forms (deleted at once, the notice was missed: issue #16)."""
        with self._lock:
            in_use = {standing.quorum for standing in (*self._formed, *self._forming)}
        self._keys.formed(quorum, in_use | ({left} if left is not None else set()))

    def drop(self, procs: ProcMesh) -> None:
        """`procs` failed (any thread): the groups it is in are broken; one it is joining
        gives up."""
        with self._lock:
            self._formed = [s for s in self._formed if procs not in s.procs]
            broken = [s for s in self._forming if procs in s.procs]
            self._forming = [s for s in self._forming if procs not in s.procs]
            self._tried = {key for key in self._tried if procs not in key}  # re-spawned: anew
        for standing in broken:
            self._notices.abort(standing.quorum, "a participant failed while it was formed")

    def give_up(self) -> None:
        """A step forms a group of its own (a fresh rendezvous): the formation under way is
        given up (aborted through the notices), so that its rendezvous do not run beside the
        step's in the same processes (they did fail each other, under load); it is tried
        again later."""
        with self._lock:
            forming, self._forming = self._forming, []
        for standing in forming:
            self._notices.abort(standing.quorum, "a step formed a group of its own meanwhile")

    def ensure(
        self,
        members: Sequence[tuple[ProcMesh, ActorMesh[Any]]],
        spares: Sequence[tuple[ProcMesh, ActorMesh[Any]]],
    ) -> None:
        """Start forming the groups of every take-over `spares` could make among `members`
        (every member live, in replica order) that were not formed yet; does not wait."""
        self._settle()
        wanted, keys = [], set()
        with self._lock:
            retry = self._formation is None and time.monotonic() >= self._retry_at
            for spare in spares:
                for place in range(len(members)):
                    taking = [*members[:place], spare, *members[place + 1 :]]
                    key = tuple(procs for procs, _ in taking)
                    keys.add(key)
                    if key not in self._tried and retry:
                        wanted.append((Standing(self._next_quorum(), key), taking))
            self._wanted = keys
            self._tried = (self._tried & keys) | {standing.procs for standing, _ in wanted}
        if wanted:
            self._start(wanted)

    def pending(self) -> bool:
        """Whether a group the last `ensure` wanted is not formed (yet)."""
        self._settle()
        with self._lock:
            return bool(self._wanted - {standing.procs for standing in self._formed})

    def _start(self, wanted: list[tuple[Standing, list[tuple[ProcMesh, ActorMesh[Any]]]]]) -> None:
        """Each participant forms its new groups in one call (and keeps its formed ones)."""
        places: dict[ProcMesh, tuple[ActorMesh[Any], list[GroupPlace]]] = {}
        for standing, taking in wanted:
            world = len(taking) * self._ranks
            for position, (procs, actors) in enumerate(taking):
                place = (standing.quorum, position * self._ranks, world)
                places.setdefault(procs, (actors, []))[1].append(place)
        groups = tuple(standing for standing, _ in wanted)
        with self._lock:
            self._forming = list(groups)
            formed = list(self._formed)
        calls = {}
        for procs, (actors, new) in places.items():
            kept = [(s.quorum, -1, -1) for s in formed if procs in s.procs]
            calls[procs] = actors.stand_by.call(sorted(new + kept), self._store, self._timeout_s)
        most = max(len(new) for _, new in places.values())  # a rendezvous each
        deadline = time.monotonic() + self._timeout_s * (most + 1)
        with self._lock:
            self._formation = _Formation(groups, calls, deadline)

    def _settle(self) -> None:
        """If the formation under way ended (or ran out of time), take its outcome: a group is
        formed if every participant formed it; the others are given up, tried again later."""
        with self._lock:
            formation = self._formation
        if formation is None:
            return
        ended = all(call.done() for call in formation.calls.values())
        if not ended and time.monotonic() < formation.deadline:
            return
        results = gather(dict(enumerate(formation.calls.values())), 0.0)
        formed_by = {
            procs: set.intersection(*(set(ranks) for ranks in result))
            for procs, result in zip(formation.calls, results.values())
            if isinstance(result, list) and result
        }
        with self._lock:
            formed = [
                s for s in self._forming if all(s.quorum in formed_by.get(p, ()) for p in s.procs)
            ]  # drop() took out those a failure broke
            failed = [s for s in formation.groups if s not in formed]
            self._formed += formed
            self._tried -= {standing.procs for standing in failed}
            if failed:
                self._retry_at = time.monotonic() + RETRY_S
            self._forming, self._formation = [], None
        for standing in failed:  # a participant still in it (or yet to start it) gives it up
            self._notices.abort(standing.quorum, "its formation failed; a new one is tried")
        errors = [result for result in results.values() if isinstance(result, BaseException)]
        if failed and errors:
            self._log.warning("standing_groups_failed", reason=short(errors[0]))
