"""A spare completes the step in flight (`ReplicaGroup(spares=K)`): a replica that dies during
`prepare` has its place taken by a ready spare in that same step, the survivors keep their
gradients and redo only the exchange, and the step commits with the bits of a fault-free one.
Where that cannot be done (the spare dies too, two deaths for one spare), the step is discarded
and retried as before. Real procs, gloo and SIGKILL.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import exchange_actors as xa
import heal_actors as ha
import pytest
import replica_actors as ra
from test_heal import _committed_reads
from test_replicas import assert_invariants, train
from test_spares import _loader_run_without_failures, _with_a_ready_spare

from mesh import this_host
from recovery import ReplicaGroup, replay_training
from recovery import parameter_digest as digest

pytestmark = pytest.mark.timeout(240)


def _fault_free(steps: int) -> str:
    """The digest of a fault-free run of three replicas, replayed in this process."""
    return digest(replay_training(ra.Trainer, [(s, (0, 1, 2)) for s in range(1, steps + 1)]))


def test_a_spare_completes_the_step_in_which_a_replica_dies_before_or_during_its_exchange(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """Replica 1 dies in the forward pass of step 3 (before its exchange), replica 0 in the
    exchange of step 6: each time a spare takes the place in that step, no step is discarded,
    and the parameters equal a fault-free run's bit for bit."""
    plan = {1: [(3, "forward")], 0: [(6, "allreduce")]}
    group = _with_a_ready_spare(groups, ra.DyingTrainer, plan, tmp_path)
    train(group, 7, full_before={5})  # the spare spawned after the first take-over is ready
    assert [(r.replica, r.by_spare) for r in group.recoveries] == [(1, True), (0, True)]
    assert all(r.first_commit_at is not None for r in group.recoveries), group.recoveries
    discarded = [o.step for o in group.outcomes if not o.committed]
    assert 3 not in discarded and 6 not in discarded, group.outcomes  # completed by spares
    assert group.history == [(s, (0, 1, 2)) for s in range(1, 8)], group.history
    assert_invariants(group)
    assert {d for e in group.status().values() for _, d in e} == {_fault_free(7)}


def test_a_step_completed_by_a_spare_reads_each_batch_once_with_the_runs_random_numbers(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """Against a run without failures: replica 1 dies in the exchange of step 3, after reading
    its batch. The spare reads that batch again, with the random numbers replica 1 drew; the
    survivors read theirs of step 3 once (no retry), and the parameters end equal, bit for bit."""
    expected, final = _loader_run_without_failures(groups, tmp_path)
    plan = {1: [(3, "allreduce")]}
    (tmp_path / "run").mkdir()  # its death marks
    group = _with_a_ready_spare(groups, ha.LoaderTrainer, plan, tmp_path / "run")
    train(group, 7)
    assert [(r.replica, r.by_spare) for r in group.recoveries] == [(1, True)], group.recoveries
    assert 3 not in [o.step for o in group.outcomes if not o.committed], group.outcomes
    reads = _committed_reads(group)
    assert set(reads) == set(expected) - {(1, 1), (1, 2)}, sorted(reads)  # its spare from 3 on
    for key, read in reads.items():
        assert read == expected[key], (key, read)
    for replica in (0, 1, 2):  # the survivors did not read step 3's batches again
        seen = group.replicas[replica].seen_batches.call_one().get(60)
        assert [step for step, _, _ in seen].count(3) == 1, (replica, seen)
    assert group.status() == final


def test_a_spare_that_dies_while_it_completes_the_step_leaves_it_discarded_and_retried(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """Replica 1 dies in the forward pass of step 3; the spare taking its place dies in the
    exchange of that step. The step is discarded, retried without replica 1, which is
    re-spawned and healed (no spare is left), and the bits equal the replay's."""
    plan = {1: [(3, "forward"), (3, "allreduce")]}  # the second: the spare, as replica 1
    group = _with_a_ready_spare(groups, ra.DyingTrainer, plan, tmp_path)
    train(group, 6)
    assert [(r.replica, r.by_spare) for r in group.recoveries] == [(1, True), (1, False)]
    discarded = [o.step for o in group.outcomes if not o.committed]
    assert discarded.count(3) == 1, group.outcomes  # a later one: a rendezvous under load
    assert_invariants(group)


def test_two_deaths_with_one_spare_discard_the_step_and_recover_as_before(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """Replicas 1 and 2 die in the exchange of step 3 and one spare is ready: the step is
    discarded; the spare takes one place, the other replica is re-spawned and healed."""
    plan = {1: [(3, "allreduce")], 2: [(3, "allreduce")]}
    group = _with_a_ready_spare(groups, ra.DyingTrainer, plan, tmp_path)
    train(group, 6)
    assert sorted((r.replica, r.by_spare) for r in group.recoveries) in (
        [(1, False), (2, True)],
        [(1, True), (2, False)],
    ), group.recoveries
    assert 3 in [o.step for o in group.outcomes if not o.committed], group.outcomes
    assert_invariants(group)


def test_a_survivor_late_to_the_exchange_a_spare_completes_is_told_and_does_not_wait(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """A spare takes replica 0's place at step 2 (the step's group is a standing one), and a
    new spare's groups form. Replica 2 dies in the exchange of step 5; replica 1 enters that
    exchange only after the spare took replica 2's place and a standing group formed after
    the step's was taken. The abort notice of the group replica 1 enters must still be
    there: taking that group deleted the older groups' store keys, notice included, and a
    survivor that had not looked yet waited in a collective until the group's timeout
    (issue #16: a take-over step of 3 s at 100 MB). Step 5 commits with the spare, well
    within the timeout (a generous bound)."""
    timeout_s = 30.0
    plan = {0: [(2, "forward", "SIGKILL")], 2: [(5, "allreduce", "SIGKILL")]}
    group = ReplicaGroup(
        this_host(), xa.LateToExchange, plan, str(tmp_path), 1, 5, replicas=3, spares=1,
        heartbeat_timeout_s=1.0, group_timeout_s=timeout_s, step_timeout_s=2 * timeout_s,
    )  # fmt: skip
    groups.append(group)
    group.wait_for_all(timeout=120)

    def go_once_the_spare_took_the_place() -> None:
        deadline = time.monotonic() + 60
        while len([r for r in group.recoveries if r.healed_at]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the standing group is taken right after
        (tmp_path / "go").touch()

    going = threading.Thread(target=go_once_the_spare_took_the_place, daemon=True)
    going.start()
    train(group, 6, full_before={4})  # the new spare is ready, its groups formed
    going.join(timeout=60)
    assert (tmp_path / "saw").read_text().startswith("the process group of quorum")
    assert [(r.replica, r.by_spare) for r in group.recoveries] == [(0, True), (2, True)]
    fifth = [o for o in group.outcomes if o.step == 5]
    assert [o.committed for o in fifth] == [True], fifth  # completed by the spare
    assert fifth[0].seconds < timeout_s / 2, fifth  # not the group's timeout
    assert_invariants(group)
