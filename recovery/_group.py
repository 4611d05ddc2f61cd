"""`ReplicaGroup`: the controller side of TorchFT-style replica training (needs torch).

N replicas (each a proc mesh of one or more ranks holding a `Replica` actor) train on a
persistent allocation. Every `step()` runs with the replicas that are up: if membership
changed, they form a fresh gloo process group; each computes its gradient, they average them
and stage the update (`prepare`); only if every participant succeeded is the step committed
everywhere, else it is aborted everywhere and retried. A replica that fails (a
`SupervisionEvent` reaches the group's handler, or its calls raise `SupervisionError`) is
re-spawned on the same allocation in the background and heals from the live replicas while
they go on stepping (`_rejoin`); it joins the step in flight once it holds the committed
state (`_inflight`), else the next one. Below `min_replicas` the group waits for
replacements, within a bound, rather than train alone.
A replica whose host is lost ("unreachable": its node died) comes back on a `spare_hosts` host.
With `spares=K`, K standby replicas follow the committed steps and a failed replica's place is
taken by one of them instead (`_standby`): in the step in flight if it died during `prepare`
(`_inflight`: the step is completed, not discarded), else at the next step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from mesh import ActorMesh, Future, HostMesh, ProcMesh
from supervision import ActorError, SupervisionError, SupervisionEvent
from transport import get_logger

from ._aborts import AbortNotices
from ._group_stop import stop_group
from ._inflight import InFlight
from ._members import PRELOAD, Member, ReplicaSpawner, commit_digests, failures, gather
from ._outcomes import Recovery, ReplicaGroupError, ReplicaLost, StepOutcome, alive, short
from ._rejoin import KEEP_WHILE_HEALING, Rejoins
from ._replica import Replica
from ._spares import SparePool, host_lost
from ._standby import Standbys, check_spares
from ._standing import StandingGroups
from ._store_server import StoreServer


class ReplicaGroup:
    """N training replicas on `hosts`, stepped together; see the module docstring."""

    def __init__(
        self,
        hosts: HostMesh,
        replica_class: type[Replica],
        *args: Any,
        replicas: int = 3,
        per_replica: Mapping[str, int] | None = None,
        min_replicas: int = 2,
        name: str = "replica",
        step_timeout_s: float = 30.0,
        group_timeout_s: float = 3.0,
        wait_for_replicas_s: float = 60.0,
        store_host: str = "127.0.0.1",
        heartbeat_timeout_s: float | None = None,
        spare_hosts: HostMesh | None = None,
        preload: Sequence[str] = PRELOAD,
        spares: int = 0,
        **kwargs: Any,
    ) -> None:
        if not 1 <= min_replicas <= replicas:
            raise ValueError(
                f"min_replicas must be between 1 and replicas ({replicas}), not {min_replicas}"
            )
        if not (isinstance(replica_class, type) and issubclass(replica_class, Replica)):
            raise TypeError(f"ReplicaGroup needs a Replica subclass, got {replica_class!r}")
        check_spares(replica_class, spares)
        self.replica_class = replica_class
        self.args, self.kwargs = args, kwargs
        self.min_replicas = min_replicas
        self.name = name
        self.step_timeout_s = step_timeout_s
        self.group_timeout_s = group_timeout_s
        self.wait_for_replicas_s = wait_for_replicas_s
        # rendezvous and abort notices; its connections fail as the procs do
        self._store = StoreServer(store_host, name, heartbeat_timeout_s)
        self._per_replica = dict(per_replica or {"gpus": 1})
        self.ranks_per_replica = math.prod(self._per_replica.values())
        self.history: list[tuple[int, tuple[int, ...]]] = []
        self.outcomes: list[StepOutcome] = []
        self.recoveries: list[Recovery] = []
        self.events: list[SupervisionEvent] = []
        self.preempted: SupervisionEvent | None = None  # a notice: the loop should drain()
        self._quorum = 0
        self._quorum_members: tuple[int, ...] | None = None
        self._current: tuple[int, tuple[int, ...]] = (0, ())  # (quorum, its members)
        self._log = get_logger("recovery.group", group=name)
        self._members: list[Member] = []  # filled as spawned: a failure may come meanwhile
        self._started = False  # failed replicas are re-spawned at once from then on
        try:
            self._assemble(hosts, replicas, preload, heartbeat_timeout_s, spare_hosts, spares)
        except BaseException:  # nothing it started outlives a constructor that raises
            standbys, notices = getattr(self, "_standbys", None), getattr(self, "_aborts", None)
            stop_group(self._members, self._store, standbys, notices)
            raise

    def _assemble(
        self, hosts: HostMesh, replicas: int, preload: Sequence[str],
        heartbeat_timeout_s: float | None, spare_hosts: HostMesh | None, spares: int,
    ) -> None:  # fmt: skip
        """Spawn the replicas and spares, and start them (`_start`)."""
        self._aborts = AbortNotices(self._store.addresses, self.group_timeout_s)
        self._standing = StandingGroups(
            self._store.addresses, self._aborts, self.ranks_per_replica, self.group_timeout_s,
            self._next_quorum, self.name,
        )  # fmt: skip
        self._spawner = ReplicaSpawner(
            hosts, self.replica_class, self.args, self.kwargs, self._per_replica, preload,
            heartbeat_timeout_s, SparePool(spare_hosts), self._on_event,
        )  # fmt: skip
        for index in range(replicas):
            procs, actors = self._spawner.spawn(f"{self.name}{index}", index)
            self._members.append(Member(index, procs, actors))
        self._keep_updates = self.replica_class.standby_updates if spares else 0
        configure = (self.ranks_per_replica, self._keep_updates)
        self._standbys = Standbys(
            self._spawner, spares, replicas, configure, self.step_timeout_s, self.name
        )
        self._rejoins = Rejoins(
            self._members, self._spawner, self._standbys, self._configure_args,
            self.step_timeout_s, self.name,
        )  # fmt: skip
        self._inflight = InFlight(
            self._members, self._standbys, self._rejoins, self._aborts, self._failed,
            self._form_group, self._call_all, lambda: self._current[0], self.name,
            self.ranks_per_replica,
        )  # fmt: skip
        self._start()

    # -- the public face ------------------------------------------------------------------------

    @property
    def committed_steps(self) -> int:
        return len(self.history)

    @property
    def replicas(self) -> list[ActorMesh[Replica]]:
        """The actor mesh of each replica, by replica id."""
        return [member.actors for member in self._members]

    @property
    def spare_replicas(self) -> list[ActorMesh[Replica]]:
        """The actor mesh of each spare (ready or not)."""
        return self._standbys.meshes

    def ready_spares(self) -> int:
        """How many spares could take a failed replica's place now."""
        return self._standbys.ready()

    def live(self) -> tuple[int, ...]:
        """The ids of the replicas that take part in the next step."""
        return tuple(m.index for m in self._members if m.state == "live")

    def wait_for_all(self, timeout: float = 60.0) -> None:
        """Wait until every replica is up and healed (replacements included), and every
        spare ready, with the process groups of its take-overs formed."""
        deadline = time.monotonic() + timeout
        spares = len(self._standbys.meshes)
        while True:
            self._recover()  # first: a spare made ready by the start has no groups asked yet
            live, ready_now = len(self.live()), self._standbys.ready()
            if live == len(self._members) and ready_now == spares and not self._standing.pending():
                return
            if time.monotonic() > deadline:
                ready = f" and {self._standbys.ready()} of {spares} spares" if spares else ""
                if self._standing.pending():
                    ready += " (the process groups of their take-overs did not form)"
                raise ReplicaGroupError(
                    f"only replicas {self.live()}{ready} are up after {timeout:g} s of waiting"
                )
            time.sleep(0.01)

    def step(self) -> StepOutcome:
        """Attempt the next step with the replicas that are up; commit it everywhere or
        nowhere. A discarded step is attempted again by the next call."""
        started = time.monotonic()
        step = self.committed_steps + 1
        members = self._await_quorum()
        if not self._form_group(members, step):
            return self._outcome(step, False, members, started, "the process group did not form")
        world = len(members) * self.ranks_per_replica
        until = self._inflight.possible(members, step)  # a spare or a replacement joins now
        prepared = self._call_all(members, "prepare", step, self._current[0], world, until=until)
        members, failed = self._inflight.complete(members, step, prepared)
        if failed:
            self._abort(members, step, failed)
            reasons = "; ".join(f"replica {i}: {short(e)}" for i, e in sorted(failed.items()))
            return self._outcome(step, False, members, started, reasons)
        # every participant's digest every check_every steps; in between, with spares or a
        # replacement on its way (its catch-up is checked against it), a share each
        check = step % self.replica_class.check_every == 0
        keep = max(self._keep_updates, KEEP_WHILE_HEALING if self._rejoins.under_way() else 0)
        committed = self._call_all(members, "commit", step, check, keep)
        for index, result in committed.items():  # the step is decided: a late death is a
            if isinstance(result, BaseException):  # failure of that replica, not of the step
                self._failed(index, f"died while committing: {short(result)}", host_lost(result))
        self.history.append((step, members))
        digests = commit_digests(committed, len(members), self._call_all, step)
        if len(digests) > 1:
            raise ReplicaGroupError(f"replicas {members} diverged at step {step}: {digests}")
        donors = [self._members[i].actors for i in members if self._members[i].state == "live"]
        self._standbys.committed(step, digests.pop() if digests else None, donors)
        now = time.monotonic()
        for index in members:
            member = self._members[index]
            recovery = member.recovery
            if member.state == "live" and recovery is not None and recovery.first_commit_at is None:
                recovery.first_commit_at = now
        return self._outcome(step, True, members, started)

    def status(self) -> dict[int, list[tuple[int, str]]]:
        """(committed step, parameter digest) of every rank of every live replica."""
        found = self._call_all(self.live(), "status")
        return {i: list(v) for i, v in found.items() if not isinstance(v, BaseException)}

    def check_consistency(self) -> str | None:
        """None if every live replica has committed every step and holds the same bits;
        otherwise what is wrong."""
        status = self.status()
        states = {entry for entries in status.values() for entry in entries}
        steps = {step for step, _ in states}
        if steps != {self.committed_steps}:
            return f"replicas are at steps {sorted(steps)}, {self.committed_steps} were committed"
        if len({d for _, d in states}) != 1:
            return f"live replicas hold different parameters: {status}"
        return None

    def drain(self) -> dict[str, Any]:
        """After a notice (`preempted`): the committed state of a live replica, to save, then
        every replica stopped. No step is left half done: `step` commits or aborts each."""
        found = self._call_all(self.live()[:1], "state")
        self.close()
        return next((v[0] for v in found.values() if isinstance(v, list)), {})

    def close(self) -> None:
        """Stop every replica and spare."""
        stop_group(self._members, self._store, self._standbys, self._aborts)

    # -- membership ------------------------------------------------------------------------------

    def _start(self) -> None:
        """Configure every replica and give them all the state of the first one that is up. A
        replica that fails meanwhile is replaced and healed like any failed replica."""
        for member in self._members:
            configured = member.actors.configure.call(*self._configure_args(member))
            self._while_starting(member, configured, self.step_timeout_s * 4)
        live = [m for m in self._members if m.state == "live"]
        for member in live[1:]:
            healed = member.actors.heal_from.call(live[0].actors)
            self._while_starting(member, healed, self.step_timeout_s)
        self._standbys.tend([m.actors for m in live[:1]])  # spares heal once their procs run
        self._started = True

    def _configure_args(self, member: Member) -> tuple[int, int, int]:
        return member.index, self.ranks_per_replica, self._keep_updates

    def _while_starting(self, member: Member, call: Future[Any], timeout_s: float) -> None:
        """Wait for a start-up `call` to `member`; if it fails, so has the member."""
        try:
            call.get(timeout=timeout_s)
        except (SupervisionError, ActorError, TimeoutError) as exc:
            why = f"failed while the group started: {short(exc)}"
            self._failed(member.index, why, host_lost(exc))

    def _on_event(self, procs: ProcMesh, event: SupervisionEvent) -> bool:
        """A failure of the replica on `procs`, from the supervision tree (event loop thread):
        of a member, a spare, or a replica already replaced (then nothing to do)."""
        if event.is_notice:  # its host goes away soon: the training loop drains
            self.preempted = self.preempted or event
            return True
        self.events.append(event)
        member = next((m for m in self._members if m.procs is procs), None)
        if member is not None:
            self._failed(member.index, str(event), host_lost(event))
        elif self._standbys.on_failure(procs, str(event), host_lost(event)):
            self._standing.drop(procs)  # the groups of its take-overs are broken
        return True

    def _failed(self, index: int, why: str, host_lost: bool = False) -> None:
        member = self._members[index]
        with member.lock:
            member.host_lost = member.host_lost or host_lost
            if member.state != "live":
                return
            quorum, participants = self._current
            if index in participants:  # before the state: a step seeing it forms a new group
                self._quorum_members = None  # (its replacement: other procs, or respawned)
            respawn = self._started and not self._standbys.ready()  # else a spare takes over
            member.state = "failed"  # (decided first: a step seeing it may take a spare now)
            self._standing.drop(member.procs)
            member.recovery = Recovery(index, time.monotonic(), why)
            self.recoveries.append(member.recovery)
        if index in participants:  # survivors waiting on it in a collective give up now
            self._aborts.abort(quorum, f"replica {index} {why}")
        self._log.warning("replica_failed", replica=index, reason=why)
        if respawn:  # now, not at the next step: the spawn is long
            self._rejoins.respawn(member)

    def _await_quorum(self) -> tuple[int, ...]:
        """The live replicas, once there are at least `min_replicas` (bounded wait)."""
        deadline = time.monotonic() + self.wait_for_replicas_s
        while True:
            self._recover()
            live = self.live()
            if len(live) >= self.min_replicas:
                return live
            if time.monotonic() > deadline:
                raise ReplicaGroupError(
                    f"only replicas {live} are up, {self.min_replicas} are needed, and no "
                    f"replacement came within {self.wait_for_replicas_s:g} s"
                )
            time.sleep(0.01)

    def _recover(self) -> None:
        """One move for each failed replica (`_rejoin`: a spare takes its place, or it is
        re-spawned and healed while the others step); tend the spares (here, between two
        steps, so that they take the state of the last committed step)."""
        if self._rejoins.tend(self.committed_steps):
            self._quorum_members = None  # the same replica ids on other procs: a fresh group
        self._standbys.tend([m.actors for m in self._members if m.state == "live"])
        if all(m.state == "live" for m in self._members):  # a take-over's group, in advance
            members = [(m.procs, m.actors) for m in self._members]
            self._standing.ensure(members, self._standbys.ready_meshes())

    def _next_quorum(self) -> int:
        self._quorum += 1
        return self._quorum

    def _form_group(self, members: tuple[int, ...], step: int) -> bool:
        if members == self._quorum_members:
            return True
        left = self._current[0]  # a step in flight may still wait in it: its keys stay
        standing = self._standing.take([self._members[i].procs for i in members])
        self._current = (self._next_quorum() if standing is None else standing, members)
        if any(self._members[i].state != "live" for i in members):
            return False  # one failed since it was counted (its abort notice may be missed)
        if standing is not None:  # formed in advance: no rendezvous
            self._quorum_members = members
            self._standing.formed(self._current[0], left)
            return True
        world = len(members) * self.ranks_per_replica
        args = (self._current[0], None, world, self._store.addresses, self.group_timeout_s, step)
        joined = self._call_all(members, "join", *args)  # None: the base, filled per member
        failed = failures(joined)
        if failed:
            for index, error in failed.items():
                if isinstance(error, SupervisionError):
                    self._failed(index, short(error), host_lost(error))
            self._quorum_members = None
            return False
        self._quorum_members = members
        self._standing.formed(self._current[0])
        return True

    # -- calls ---------------------------------------------------------------------------------

    def _call_all(
        self, members: tuple[int, ...], endpoint: str, *args: Any, until: Any = None
    ) -> dict[int, Any]:
        """Call `endpoint` on every rank of each member at once; per member, the list of
        values (rank order) or the error (`until`: see `gather`)."""
        futures, gone = {}, {}
        # with spares or a replacement on its way, each commit's digest though no check is due
        shared = endpoint == "commit" and (self._standbys.meshes != [] or self._rejoins.under_way())
        for position, index in enumerate(members):
            call_args = list(args)
            if endpoint == "join":
                call_args[1] = position * self.ranks_per_replica
            elif shared and not args[1]:
                call_args[1] = (position, len(members))  # its share of the spares' digest
            member = self._members[index]
            with member.lock:  # a failed member's replacement may be on its way: not to it
                if member.state != "live":
                    gone[index] = ReplicaLost(f"replica {index} failed during this step")
                    continue
                futures[index] = getattr(member.actors, endpoint).call(*call_args)
        return gather(futures, self.step_timeout_s, until) | gone

    def _abort(self, members: tuple[int, ...], step: int, failed: dict[int, Any]) -> None:
        """Undo `step` everywhere it was prepared; replicas that died are re-spawned."""
        for index, error in failed.items():
            if isinstance(error, SupervisionError):
                self._failed(index, short(error), host_lost(error))
        survivors = tuple(i for i in members if i not in failed or alive(failed[i]))
        self._call_all(survivors, "abort", step)
        self._quorum_members = None  # a collective failed: the group must be formed again

    def _outcome(
        self, step: int, committed: bool, members: tuple[int, ...], started: float, reason: str = ""
    ) -> StepOutcome:
        outcome = StepOutcome(step, committed, members, time.monotonic() - started, reason)
        self.outcomes.append(outcome)
        if not committed:
            self._log.warning("step_discarded", step=step, replicas=list(members), reason=reason)
        return outcome
