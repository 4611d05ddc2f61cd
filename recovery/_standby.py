"""Hot spares of a `ReplicaGroup`: standby replicas that take a failed replica's place at the
next step.

A spare is spawned and built like any replica (without random initialisation: it heals every
tensor, as a replacement does) and healed to the committed state once, beside
the steps (like a replacement: a commit that overtakes the heal is replayed on it; the spare is
ready at the step it reached, checked against that step's digest). From then on it stays off
the step's path: after each commit the controller asks it to `follow` (pull the step's
averaged gradient from a participant and apply it, see `_follow` and `_prefetch`) without
waiting for it, and checks the digest it reports every `standby_follow_every` steps against
the step's. When a replica fails, a ready spare takes its place at the next step
(`take_place`: it catches up on the updates it lacks and takes the data position and RNG
states of a peer); a new spare is spawned in the background. A spare that fails is re-spawned
in place and healed again; the steps never wait for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mesh import ActorMesh, Future, ProcMesh
from supervision import ActorError, SupervisionError
from transport import get_logger

from ._follow import Takeover
from ._members import Member, ReplicaSpawner
from ._outcomes import short
from ._replica import Replica

#: The digests of this many recent committed steps are kept, to check what spares report.
DIGESTS_KEPT = 64


def check_spares(replica_class: type[Replica], spares: int) -> None:
    """Refuse a spare count, or settings of `replica_class`, that cannot work."""
    check = replica_class.check_every
    if type(check) is not int or check < 1:
        raise ValueError(
            f"{replica_class.__name__}.check_every must be a whole number of steps >= 1, "
            f"not {check!r}"
        )
    if type(spares) is not int or spares < 0:
        raise ValueError(f"spares must be a whole number >= 0, not {spares!r}")
    every, keep = replica_class.standby_follow_every, replica_class.standby_updates
    if spares and not (type(every) is int and type(keep) is int and 1 <= every <= keep // 2):
        raise ValueError(
            f"{replica_class.__name__}.standby_follow_every must be a whole number from 1 to "
            f"half its standby_updates ({keep!r}), not {every!r}: spares are checked that "
            "often, and catch up from the updates their peers keep"
        )


@dataclass(eq=False)
class Spare:
    """One standby replica and where it stands."""

    number: int
    procs: ProcMesh
    actors: ActorMesh[Replica]
    state: str = "starting"  # starting | behind (needs a heal) | healing | ready | taking | failed
    up: Future[Any] | None = None  # done once its procs run (configured)
    healing: Future[Any] | None = None  # its heal, beside the steps
    follows: list[tuple[Future[Any], int]] = field(default_factory=list)  # (call, step asked)
    verified: int = -1  # the last committed step its digest was found equal to the group's
    reached: int = -1  # the last committed step it was seen to hold (checked or not)
    checked: int = -1  # the last step a follow was asked to hash its parameters at
    host_lost: bool = False


class Standbys:
    """The spares of one group: `count` of them, kept ready; see the module docstring."""

    def __init__(
        self,
        spawner: ReplicaSpawner,
        count: int,
        first_slot: int,
        configure_args: tuple[int, int],
        timeout_s: float,
        name: str,
    ) -> None:
        self._spawner = spawner
        self._first_slot = first_slot
        self._configure_args = configure_args  # (ranks per replica, updates kept)
        self._timeout_s = timeout_s
        self._name = name
        self._lock = threading.Lock()
        self._spares: list[Spare] = []
        self._made = 0
        self._digests: dict[int, str] = {}
        self._retired: list[Future[None]] = []  # the old procs of replaced replicas, stopping
        self._owed: list[ProcMesh] = []  # procs to stop, and a spare to spawn, for each
        self._log = get_logger("recovery.spares", group=name)
        self._follow_every = spawner.replica_class.standby_follow_every
        # follow calls of a spare under way at most: those beside the one applying fetch
        # what it lacks before its peers drop it, and hold no more updates than they keep
        # (half the actor's concurrent calls at most: take-overs and heals are left some)
        kind = spawner.replica_class
        self._in_flight = min(kind.standby_updates, kind.max_concurrent_calls // 2)
        for _ in range(count):
            self._spawn()

    @property
    def meshes(self) -> list[ActorMesh[Replica]]:
        with self._lock:
            return [spare.actors for spare in self._spares]

    def ready_meshes(self) -> list[tuple[ProcMesh, ActorMesh[Replica]]]:
        """The meshes of the spares that could take a place now."""
        with self._lock:
            return [(s.procs, s.actors) for s in self._spares if s.state == "ready"]

    def digest_of(self, step: int) -> str | None:
        """The parameter digest of committed `step`, if the group took it (every step with
        spares, and while a replacement is on its way), for the last `DIGESTS_KEPT` steps."""
        return self._digests.get(step)

    def ready(self) -> int:
        """How many spares could take a place now."""
        with self._lock:
            return sum(spare.state == "ready" for spare in self._spares)

    def on_failure(self, procs: ProcMesh, why: str, host_lost: bool) -> bool:
        """The spare on `procs` failed (from supervision, any thread): it is re-spawned at the
        next `tend`. A spare already failed or coming up again ignores a late report (False)."""
        with self._lock:
            spare = next((s for s in self._spares if s.procs is procs), None)
            if spare is None or spare.state in ("failed", "starting"):
                return False
            spare.state = "failed"
            spare.host_lost = spare.host_lost or host_lost
        self._log.warning("spare_failed", spare=spare.number, reason=why)
        return True

    # -- between two steps -----------------------------------------------------------------

    def tend(self, donors: Sequence[ActorMesh[Replica]]) -> None:
        """Re-spawn failed spares (in the background), start a heal from `donors` (the live
        replicas) of those up but behind, and look at the heals that ended; never waits."""
        for spare in self._snapshot():
            if spare.state == "failed":
                self._respawn(spare)
            elif spare.state == "starting" and spare.up is not None and spare.up.done():
                error, spare.up = spare.up.exception(), None
                self._set(spare, "failed" if error is not None else "behind", error)
            elif spare.state == "healing" and spare.healing is not None and spare.healing.done():
                self._healed(spare)
            if spare.state == "behind" and donors and not self._following(spare):
                self._heal(spare, donors)  # (not while a follow may still apply updates)

    def replace(self, member: Member, step: int, donors: Sequence[ActorMesh[Replica]]) -> bool:
        """Whether a ready spare took failed `member`'s place at committed `step` (caught up
        from `donors`). Its meshes are the member's now; after the next commit the old ones
        stop and a new spare is spawned (not before: the step it joins has the CPU to itself)."""
        taken = self._take(member.index, step, donors)
        if taken is None:
            return False
        spare, takeover = taken
        retired = member.procs
        with member.lock:  # the member holds the spare's procs before they stop being a spare's
            member.procs, member.actors = spare.procs, spare.actors
            member.host_lost, member.state = False, "live"
        with self._lock:
            self._spares.remove(spare)
        self._owed.append(retired)
        assert member.recovery is not None
        member.recovery.respawned_at = member.recovery.healed_at = time.monotonic()
        member.recovery.by_spare = True
        self._log.info("spare_took_place", replica=member.index, spare=spare.number, how=takeover)
        return True

    def _take(
        self, index: int, step: int, donors: Sequence[ActorMesh[Replica]]
    ) -> tuple[Spare, Takeover] | None:
        """A ready spare made replica `index` at committed `step`, or None if none could."""
        for spare in self._snapshot():
            self._following(spare)
            if spare.state != "ready":
                continue
            expected = None if spare.verified == step else self._digests.get(step, "unknown")
            self._set(spare, "taking")
            try:
                done = spare.actors.take_place.call(index, step, expected, list(donors))
                takeover = next(iter(done.get(timeout=self._timeout_s).values()))
            except (SupervisionError, ActorError, TimeoutError) as exc:
                self._set(spare, "failed" if isinstance(exc, SupervisionError) else "behind", exc)
                continue
            return spare, takeover
        return None

    # -- after each commit -----------------------------------------------------------------

    def committed(
        self, step: int, digest: str | None, donors: Sequence[ActorMesh[Replica]]
    ) -> None:
        """Step `step` was committed with parameters `digest` by `donors`: every ready spare
        follows it (not waited for), even while an earlier follow applies its updates, so that
        it fetches them while kept; every `follow_every` steps it hashes its parameters too."""
        if digest is not None:  # always, with spares
            self._digests[step] = digest
        self._digests.pop(step - DIGESTS_KEPT, None)
        self._retired = [future for future in self._retired if not future.done()]
        while self._owed:
            self._retired.append(self._owed.pop().stop(grace_s=1.0))  # not waited for
            self._spawn()
        for spare in self._snapshot():
            asked = spare.follows[-1][1] if self._following(spare) else spare.reached
            if spare.state == "ready" and step > asked and len(spare.follows) < self._in_flight:
                check = step - spare.checked >= self._follow_every
                # from the participants, the last first
                call = spare.actors.follow.call(step, list(reversed(donors)), check)
                spare.follows.append((call, step))
                spare.checked = step if check else spare.checked

    def close(self) -> None:
        """Stop every spare, and what is left of the replicas they replaced."""
        owed, self._owed = self._owed, []
        stopping = [procs.stop(grace_s=1.0) for procs in owed + [s.procs for s in self._snapshot()]]
        for future in stopping + self._retired:
            try:
                future.get(timeout=10.0)
            except Exception:
                pass

    # -- inside --------------------------------------------------------------------------------

    def _spawn(self) -> None:
        number, self._made = self._made, self._made + 1
        procs, actors = self._spawner.spawn(
            f"{self._name}-spare{number}", self._first_slot + number, spare=True
        )
        spare = Spare(number, procs, actors)
        spare.up = actors.configure.call(-1, *self._configure_args)
        with self._lock:
            self._spares.append(spare)

    def _snapshot(self) -> list[Spare]:
        with self._lock:
            return list(self._spares)

    def _set(self, spare: Spare, state: str, why: BaseException | None = None) -> None:
        with self._lock:
            if spare.state == "failed" and state != "starting":
                return  # supervision said it died: only a re-spawn changes that
            spare.state = state
        if why is not None:
            self._log.warning("spare_" + state, spare=spare.number, reason=short(why))

    def _respawn(self, spare: Spare) -> None:
        lost, spare.host_lost = spare.host_lost, False
        spare.follows.clear()
        spare.healing = None  # (it ends in a failure: the procs it ran on died)
        spare.procs.respawn(on=self._spawner.spare_hosts.take() if lost else None)
        spare.up = spare.actors.configure.call(-1, *self._configure_args)
        self._set(spare, "starting")

    def _heal(self, spare: Spare, donors: Sequence[ActorMesh[Replica]]) -> None:
        """Start healing `spare` from `donors`, beside the steps (they serve the committed
        state while they step; a commit that overtakes the heal is replayed on it): at 1 GB a
        heal waited for between two steps stalled every replica for 0.5 s and more."""
        spare.healing = spare.actors.heal_from.call(list(donors))
        self._set(spare, "healing")

    def _healed(self, spare: Spare) -> None:
        """The heal of `spare` ended: it is ready at the step it reached, if it holds the
        group's bits there (a heal that applied committed updates shows the step's digest)."""
        healing, spare.healing = spare.healing, None
        assert healing is not None
        error = healing.exception()
        if error is not None:
            self._set(spare, "failed" if isinstance(error, SupervisionError) else "behind", error)
            return
        reports = list(healing.get().values())
        step = min(report.step for report in reports)
        expected = self._digests.get(step, "unknown")
        if any(r.step != step or (r.updates and r.digest != expected) for r in reports):
            why = f"its heal reached {sorted((r.step, r.digest) for r in reports)}"
            self._set(spare, "behind", RuntimeError(f"{why}, not step {step} with {expected}"))
            return
        spare.verified = spare.reached = spare.checked = step
        self._set(spare, "ready")
        self._log.info("spare_ready", spare=spare.number, step=step)

    def _following(self, spare: Spare) -> bool:
        """Whether a follow call of the spare is still under way, once its finished ones
        (in the order they were made) are looked at."""
        while spare.follows and spare.follows[0][0].done():
            future, asked = spare.follows.pop(0)
            if spare.state == "ready":
                self._check(spare, future, asked)
        return bool(spare.follows)

    def _check(self, spare: Spare, future: Future[Any], asked: int) -> None:
        """Look at a finished follow call, asked to reach step `asked`: where the spare got
        to (that step, or a later one a follow beside it reached first), with which bits."""
        error = future.exception()
        if error is not None:
            self._set(spare, "failed" if isinstance(error, SupervisionError) else "behind", error)
            return
        reached = set(future.get().values())
        step = max(held for held, _ in reached)
        expected = (step, self._digests.get(step))
        if step >= asked and reached in ({expected}, {(step, "")}):  # "": asked not to hash
            spare.reached = max(spare.reached, step)
            spare.verified = max(spare.verified, step) if reached == {expected} else spare.verified
            return
        why = f"it reached {sorted(reached)} where the group committed {expected}"
        self._set(spare, "behind", RuntimeError(why))  # cannot follow: heal its whole state
