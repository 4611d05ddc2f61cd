"""`Replica`: the actor side of TorchFT-style replica training (needs torch).

A replica holds a full copy of the model and its optimizer. Each step is two-phase: `prepare`
computes the local gradient and averages it with every participant's over a gloo process group
(a reduce-scatter and an all-gather, summed in a fixed order: `_exchange`); `commit` applies
the average with the optimizer, `abort` drops it. The average has the same bits on every
participant, so a step is applied everywhere or nowhere without a copy of the state to roll
back to, and every participant ends it with bitwise-identical parameters. A replacement
replica heals by pulling the state of a live peer straight from that peer's actor (tensors
travel out of band, zero-copy).

The step arithmetic lives in plain functions (`_arithmetic`) shared with `replay_training`,
which recomputes a run in one process from its history: the result must equal the replicas'
parameters bit for bit, which is how the tests prove that no step was lost, applied twice or
half-applied.

Healing streams the state in chunks from every live peer at once (`_heal`), data position and
RNG states included (`_position`); a discarded step puts the data position and RNG states back.
A spare follows the group by applying the averaged gradients of committed steps (`_follow`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from mesh import Actor, concurrent_endpoint, context, endpoint
from transport import Addresses

from ._aborts import AbortWatch
from ._ahead import (
    Ahead,
    AheadPlan,
    begin_step,
    compute_gradient,
    drop_ahead,
    leave_steps,
    undo_step,
)
from ._arithmetic import (
    apply_average,
    commit_digest,
    digest,
    flat_gradient,
)
from ._build import random_init_skipped, warm_up_in_background, will_heal
from ._exchange import GroupPlace, HeldGroups, exchange_average, open_group
from ._follow import Lowered, Takeover, UpdateLog, rank_match, warm_up_autograd, warm_up_gloo
from ._heal import HealReport, endpoints_of, heal
from ._heal_catch_up import caught_up
from ._heal_donor import DonorCache, Stale, StepStart
from ._heal_groups import update_fetcher
from ._heal_state import Chunk, Piece, StateLayout
from ._prefetch import Prefetched, follow_group, take_over

if TYPE_CHECKING:
    import torch

    from mesh import ActorMesh


class Replica(Actor):
    """Base class of a training replica; subclass it and implement `build` and `loss`.

    ``build()`` returns ``(model, optimizer)`` built deterministically (seed torch first), and
    ``loss(model, step, shard)`` the loss of the batch that `shard` trains on at `step`
    (deterministic in both). Shard ``replica_id * ranks_per_replica + rank`` is this rank's.
    A replica that reads batches from a data loader also implements `data_state` and
    `load_data_state`, so that a replacement goes on from the group's position.
    """

    #: Healing moves the state in chunks of this many bytes, this many in flight per peer.
    heal_chunk_bytes: int = 8 << 20
    heal_window: int = 4
    heal_timeout_s: float = 60.0
    #: In a group with spares, each replica keeps the averaged gradients of this many
    #: committed steps (as much memory as that many gradients) for spares to catch up from;
    #: spares follow every step and hash their state every `standby_follow_every` steps.
    standby_updates: int = 4
    standby_follow_every: int = 2
    #: The group compares the replicas' parameter digests (a hash of every parameter's bytes,
    #: which costs about a pass over them) every this many steps; with spares, the first
    #: participant hashes every step (the spares' checks need each committed step's digest).
    check_every: int = 16
    #: A replacement (an actor rebuilt after a failure) and a spare build their model with
    #: random initialisations skipped, since they heal every tensor of their state; set
    #: False if `build` draws random tensors that are not in the state dict.
    skip_init_when_replacing: bool = True

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)  # reductions in the same order everywhere: bitwise replays
        # a replacement's initial values are never read: it heals (or builds again, `_built`)
        self._uninitialised = self.skip_init_when_replacing and will_heal()
        with random_init_skipped() if self._uninitialised else nullcontext():
            self.model, self.optimizer = self.build()
        self.committed_step = 0  # the number of steps committed so far
        self.replica_id = -1
        self.ranks_per_replica = 1
        self._aborts: AbortWatch | None = None
        self._group: Any = None
        self._quorum = -1
        self._started: StepStart | None = None  # what the step under way changes, for abort
        self._computed = 0  # the step whose local gradient `_gradient` holds, until decided
        self._rank = 0  # of this replica's ranks
        self._stepping = threading.Lock()  # prepare, commit and abort: one at a time
        self._ahead = Ahead()  # a replacement's first gradient, computed as it waits
        self._changing = threading.Lock()  # a change of the state, against serving a heal
        self._gradient: torch.Tensor | None = None  # reused each step
        self._donor = DonorCache()
        self._update: torch.Tensor | None = None  # the averaged gradient of a prepared step
        self._reused: torch.Tensor | None = None  # a done update's memory, for the next one
        self._updates = UpdateLog()
        self._lowered = Lowered()  # a spare's priority while it follows
        self._prefetched = Prefetched()  # a spare's updates fetched, not applied yet
        self._standing = HeldGroups()  # process groups formed for take-overs
        self.last_heal: HealReport | None = None

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        raise NotImplementedError("a Replica subclass must implement build()")

    def loss(self, model: torch.nn.Module, step: int, shard: int) -> torch.Tensor:
        raise NotImplementedError("a Replica subclass must implement loss(model, step, shard)")

    def on_phase(self, phase: str, step: int) -> None:
        """Called as each phase of a step begins ("join" when the group is formed for it,
        "forward", "allreduce"; then "commit" and "apply" once the step is decided);
        override to instrument a replica (or, in tests, to make it fail at a chosen point).
        A donor also calls it as it sends each chunk of a heal: ("heal", committed step), a
        spare as it starts to follow the group: ("follow", the step it is asked to reach), and
        a replica as it is asked to form standing groups, on that call's thread, beside its
        steps: ("stand_by", committed step)."""

    def data_state(self) -> Any:
        """The position of this replica's data loader after the committed steps: small,
        picklable, and the same for every replica (a count of batches, an epoch, not this
        shard's indices). The default None suits `loss` that picks batches by step alone."""
        return None

    def load_data_state(self, state: Any) -> None:
        """Put this replica's data loader at `state` (from `data_state` of a peer, or of this
        replica before a discarded step), for this replica's own shard."""

    # -- membership ---------------------------------------------------------------------------

    @endpoint
    def configure(self, replica_id: int, ranks_per_replica: int, keep_updates: int = 0) -> None:
        """Take the place of replica `replica_id` (-1: a spare); keep the updates of the last
        `keep_updates` committed steps for spares (0: the group has none)."""
        self._configure(replica_id, ranks_per_replica, keep_updates)
        self._built()
        if replica_id >= 0:  # it steps from the start: its update log's memory, faulted in now
            self._updates.provide([flat_gradient(self.model) for _ in range(keep_updates)])

    @endpoint
    def rejoin(
        self,
        replica_id: int,
        ranks_per_replica: int,
        keep_updates: int,
        peers: Sequence[ActorMesh[Replica]],
    ) -> HealReport:
        """A replacement: take the place of replica `replica_id` and heal from `peers` at once,
        as soon as it runs, then catch up on the steps they committed meanwhile: all of it
        while they go on stepping (`_heal_catch_up`)."""
        self._configure(replica_id, ranks_per_replica, keep_updates)
        leave_steps(self)  # a rank that lived on may still be in a step of the old group
        report = self._heal(list(peers))
        ahead = AheadPlan(self, context().rank.rank)  # then its first step's gradient
        kept = (ahead.keep_gradient, lambda u: setattr(self, "_reused", u))
        warm_up_in_background(self.model, self._stepping, *kept, ahead.after_warm_up)
        try:
            with self._lowered.first():
                report = caught_up(self, report, peers, context().rank.rank)
        except BaseException:
            ahead.given_up()
            raise
        ahead.caught_up()
        return report

    def _built(self) -> None:
        """Build the model again, initialised, if this replacement skipped its initialisation
        and has not healed: the group had nothing to heal it from (nothing committed yet)."""
        with self._changing:
            if self._uninitialised:
                self.model, self.optimizer = self.build()
                self._uninitialised = False

    def _configure(self, replica_id: int, ranks_per_replica: int, keep_updates: int) -> None:
        self.replica_id = replica_id
        self.ranks_per_replica = ranks_per_replica
        self._updates.resize(keep_updates)
        if replica_id < 0:
            warm_up_gloo()  # a spare joins a step's group in a hurry
            warm_up_autograd(self.model)

    @endpoint
    def join(
        self,
        quorum: int,
        base: int,
        world: int,
        store: Addresses,
        timeout_s: float,
        step: int = 0,
    ) -> None:
        """Enter the process group of `quorum` (a fresh one per membership) for `step`: this
        replica's ranks take the group ranks from `base` on. Gives up as soon as the group's
        controller says that a member failed (`ExchangeAborted`)."""
        self.on_phase("join", step)
        self._built()
        if self._started is not None and not self._ahead.running:  # a prepare still in the
            with self._stepping:  # old group (`_inflight`) ends first: it watches its abort
                pass
        self._rank = context().rank.rank
        self._group, self._quorum = None, -1  # the old group: its peers may be gone
        if self._aborts is None:  # a standing formation made one already, off the step
            self._aborts = self._standing.watch or AbortWatch(store, timeout_s)
        self._aborts.quorum = quorum
        self._group = open_group(store, quorum, base + self._rank, world, timeout_s, self._aborts)
        self._quorum = quorum

    @concurrent_endpoint
    def stand_by(
        self, groups: Sequence[GroupPlace], store: Addresses, timeout_s: float
    ) -> list[int]:
        """Form the process groups of the take-overs this replica would be in, in advance
        (see `_standing`); `prepare` of one of their quorums enters it without a rendezvous.
        Concurrent: the replica steps meanwhile. Returns the quorums of the groups formed."""
        self.on_phase("stand_by", self.committed_step)
        return self._standing.form(groups, context().rank.rank, store, timeout_s)

    # -- one step -----------------------------------------------------------------------------

    @concurrent_endpoint
    def prepare(self, step: int, quorum: int, world: int, exchange: bool = True) -> None:
        """Phase one of `step`: gradient and exchange. The averaged gradient is kept, not yet
        applied: it is the same bits on every participant, so `commit` applies it and `abort`
        only drops it (no copy of the state is needed to undo the step). Concurrent, so that
        this replica serves heals (of the committed state) while it computes. Asked again for
        the same step, undecided (a spare took a dead participant's place: `_inflight`), it
        keeps its gradient and redoes only the exchange; without `exchange`, it stops there."""
        with self._stepping:
            standing = self._standing.take(quorum, self._group)
            if standing is not None:  # a take-over's group, formed in advance
                self._group, self._quorum = standing, quorum
                self._rank = context().rank.rank
                self._aborts = self._aborts or self._standing.watch
                assert self._aborts is not None  # set by stand_by before it formed any
                self._aborts.quorum = quorum
            if quorum != self._quorum or self._group is None:
                raise RuntimeError(f"replica {self.replica_id} is not in quorum {quorum}")
            if step != self.committed_step + 1:
                raise RuntimeError(
                    f"replica {self.replica_id} asked to prepare step {step} after committing "
                    f"{self.committed_step}"
                )
            if not begin_step(self, step):
                compute_gradient(self, step)
            if not exchange:
                return
            self.on_phase("allreduce", step)
            assert self._aborts is not None and self._gradient is not None  # set by join, above
            reused, self._reused = self._reused, None  # lost if given up: gloo may write it
            self._update = exchange_average(self._group, self._gradient, self._aborts, reused)

    @endpoint
    def commit(
        self, step: int, with_digest: bool | tuple[int, int] = False, keep_updates: int = 0
    ) -> str | list[tuple[int, str]] | None:
        """Phase two of `step`: apply the averaged gradient. Returns the new parameters' digest
        if `with_digest` (checks), or share (part, parts) of it (`digest_part`, for spares).
        Keeps the updates of the last `keep_updates` steps (for spares and replacements)."""
        with self._stepping, self._changing:
            if self._update is None or step != self.committed_step + 1:
                raise RuntimeError(f"replica {self.replica_id} has no prepared step {step}")
            self.on_phase("commit", step)
            self._donor.clear()  # the state changes now
            self.on_phase("apply", step)
            apply_average(self.model, self.optimizer, self._update)
            self._started, self._computed = None, 0
            self.committed_step = step
            if keep_updates != self._updates.keep:
                self._updates.resize(keep_updates)
            self._reused = self._updates.record(step, self._update)  # memory for the next
            self._update = None
            return commit_digest(self.model, with_digest)

    @endpoint
    def abort(self, step: int) -> int:
        """Drop a prepared step (if any): the parameters are still those of the last commit.
        Its local gradient, if computed, is kept (with the buffers, data position and RNG
        states its forward pass moved on): the group retries the step with the members left,
        and the retry only exchanges it (its bits are those of a gradient computed anew)."""
        with self._stepping, self._changing:
            self._update, self._reused = None, self._update
            if self._computed != step or step != self.committed_step + 1:
                self._computed = 0
                undo_step(self)  # else put back by a later abort, or a heal
            return self.committed_step

    # -- state ----------------------------------------------------------------------------------

    @endpoint
    def state(self) -> dict[str, Any]:
        """The committed state (tensors go out of band); a discarded step's gradient is dropped."""
        with self._stepping, self._changing:
            if self._update is not None:
                raise RuntimeError("a step is prepared but not committed: its state is not final")
            self._computed = 0
            undo_step(self)
        return {
            "step": self.committed_step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    @endpoint
    def heal_from(self, peers: ActorMesh[Replica] | Sequence[ActorMesh[Replica]]) -> HealReport:
        """Take the committed state of `peers` (live replicas; from each, the rank matching
        this one), in chunks spread over all of them; see `recovery._heal`."""
        leave_steps(self)
        return self._heal(peers)

    def _heal(self, peers: ActorMesh[Replica] | Sequence[ActorMesh[Replica]]) -> HealReport:
        meshes = [peers] if not isinstance(peers, Sequence) else list(peers)
        ranks = [rank_match(mesh, context().rank.rank) for mesh in meshes]
        with self._changing:
            self._started = self._update = None
            self._computed = 0
            self._donor.clear()
        updates = update_fetcher(ranks, self.model, self.heal_timeout_s)
        sizes = self.heal_chunk_bytes, self.heal_window, self.heal_timeout_s
        self.last_heal = heal(self, list(map(endpoints_of, ranks)), *sizes, updates)
        self._uninitialised = False
        return self.last_heal

    @concurrent_endpoint
    def heal_layout(self) -> StateLayout:
        """The layout of the committed state, for a replacement healing from this replica
        (while it steps, too: a step changes the state only when it is committed)."""
        self._built()
        with self._changing:
            return self._donor.layout(self, False, self._started)

    @concurrent_endpoint
    def heal_chunks(self, step: int, pieces: Sequence[Piece]) -> list[Chunk] | Stale:
        """Bytes of the committed state of `step` (tensor, start, stop), sent from memory;
        `Stale` if this replica does not hold that step (`_heal_donor`)."""
        self.on_phase("heal", step)
        with self._changing:
            return self._donor.chunks(self, step, pieces, False, self._started)

    # -- spares -------------------------------------------------------------------------------

    @concurrent_endpoint
    def committed_updates(
        self, first: int, last: int, span: tuple[int, int] | None = None
    ) -> list[torch.Tensor] | None:
        """The averaged gradients of committed steps `first`..`last` (elements `span` of each,
        if given: a heal needs only some parameters'), for a spare to apply (sent from this
        replica's memory, no copy); None unless this replica keeps them all
        (`standby_updates`)."""
        return self._updates.lend(first, last, span)

    @concurrent_endpoint
    def follow(
        self, step: int, peers: Sequence[ActorMesh[Replica]], check: bool = True
    ) -> tuple[int, str]:
        """A spare: fetch the committed updates after its own step up to `step` from the first
        of `peers` that keeps them, at once, then apply them at a low priority (`_prefetch`).
        Returns the step it holds and, if `check`, its digest ("" if not)."""
        ranks = [rank_match(peer, context().rank.rank) for peer in peers]
        return follow_group(self, step, ranks, check)

    @concurrent_endpoint
    def take_place(
        self, replica_id: int, step: int, expected: str | None, peers: Sequence[ActorMesh[Replica]]
    ) -> Takeover:
        """A spare becomes replica `replica_id` at committed `step`: it catches up from
        `peers`' updates and takes their data position and RNG states; it heals its whole
        state from them instead if it cannot, or if its parameters do not match `expected`
        (the digest of `step`; None: already checked). Concurrent: a follow under way (at a
        low priority) is raised to its own and waited for, not queued behind."""
        drop_ahead(self)
        with self._lowered.first():
            self.replica_id = replica_id
            return take_over(self, step, expected, peers, context().rank.rank)

    @endpoint
    def status(self) -> tuple[int, str]:
        """The committed step and the digest of the parameters."""
        return self.committed_step, digest(self.model)

    @endpoint
    def parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict())
