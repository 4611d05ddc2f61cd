"""Healing a replacement replica: chunked, from several peers, in bounded memory, surviving the
death of a peer mid-heal, with the data loader's position and the RNG states; real
`ReplicaGroup`s with real procs, gloo and SIGKILL.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import heal_actors as ha
import pytest
from test_replicas import assert_invariants, pid_of, train, train_until_recovered

from mesh import this_host
from recovery import HealReport, ReplicaGroup
from supervision import ActorError

pytestmark = pytest.mark.timeout(300)

HB = 1.0


# -- real replica groups ---------------------------------------------------------------------


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _wait_until_failed(group: ReplicaGroup, replica: int) -> None:
    _wait_for(lambda: replica not in group.live(), "the group never noticed the kill")


def test_a_200mb_state_heals_from_two_peers_in_bounded_memory(
    groups: list[ReplicaGroup],
) -> None:
    group = ReplicaGroup(
        this_host(), ha.BigTrainer, replicas=3, heartbeat_timeout_s=HB, step_timeout_s=120
    )
    groups.append(group)
    train(group, 2)
    os.kill(pid_of(group, 2), signal.SIGKILL)
    _wait_until_failed(group, 2)
    before = {i: group.replicas[i].reset_peak.call_one().get(timeout=60) for i in (0, 1)}
    group.wait_for_all(timeout=180)
    memory = {i: group.replicas[i].memory.call_one().get(timeout=60) for i in (0, 1, 2)}
    report = memory[2]["heal"]
    state = report.nbytes
    assert state > 190e6, report
    assert report.lost_donors == () and all(n > 0 for n in report.chunks_per_donor), report
    for donor in (0, 1):
        grown = memory[donor]["peak"] - before[donor]
        assert grown < 0.5 * state, f"donor {donor} grew by {grown} bytes for a {state} state"
    # A replacement's parameters take memory as the heal writes them, not when built (it
    # skips their initialisation); once healed it takes its first step's memory: its flat
    # gradient and the averaged one (each as large), and, as it computes that gradient ahead,
    # the gradient autograd makes of its largest parameter (here the weight, nearly all).
    made = report.allocated_bytes + 4 * memory[2]["params"]
    grown = memory[2]["peak"] - memory[2]["built"] - made
    assert grown < 0.5 * state, f"the receiver grew by {grown} bytes beyond the state it made"
    assert group.check_consistency() is None  # the same step and bits everywhere
    train(group, 3)
    assert group.check_consistency() is None


def test_a_peer_dying_mid_heal_leaves_its_chunks_to_the_other(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    group = ReplicaGroup(
        this_host(), ha.DonorDiesMidHeal, 1, str(tmp_path), replicas=3, heartbeat_timeout_s=HB
    )
    groups.append(group)
    train(group, 2)
    os.kill(pid_of(group, 2), signal.SIGKILL)
    _wait_until_failed(group, 2)
    group.wait_for_all(timeout=120)  # 2 heals from 0 and 1, and 1 dies meanwhile
    _wait_for(lambda: len(group.recoveries) == 2, "the group never noticed the donor's death")
    group.wait_for_all(timeout=120)  # 1 comes back and heals from 0 and 2
    assert (tmp_path / "donor-died").exists()
    report = group.replicas[2].last_heal_report.call_one().get(timeout=60)
    assert report.lost_donors == (1,), report
    assert report.chunks_per_donor[1] == 2 and report.chunks_per_donor[0] > 2, report
    assert [r.replica for r in group.recoveries] == [2, 1], group.recoveries
    assert group.check_consistency() is None
    train(group, 4)
    train_until_recovered(group)
    assert_invariants(group)
    _bad_requests_are_refused(group)


def _bad_requests_are_refused(group: ReplicaGroup) -> None:
    """A donor refuses bad chunk requests with the reason, and answers a request for another
    step that it does not hold with `Stale` (the heal asks another donor); a replica whose
    model differs from the peer's refuses to heal from it. Both live on."""
    donor = group.replicas[0]
    step = group.committed_steps
    with pytest.raises(ActorError, match="names no tensor"):
        donor.heal_chunks.call_one(step, [(10**6, 0, 1)]).get(timeout=60)
    with pytest.raises(ActorError, match=r"outside tensor model\.0\.weight"):
        donor.heal_chunks.call_one(step, [(0, 0, 10**9)]).get(timeout=60)
    stale = donor.heal_chunks.call_one(step - 1, [(0, 0, 4)]).get(timeout=60)
    assert type(stale).__name__ == "Stale", stale  # an answer, not an error: ask another
    assert (stale.asked, stale.committed) == (step - 1, step)
    assert "heal again from the current step" in str(stale)
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="wider")
    try:
        wider = procs.spawn("wider", ha.WiderTrainer)
        with pytest.raises(ActorError, match=r"model\.0\.weight is float32\[16, 8\]"):
            wider.heal_from.call_one(donor).get(timeout=60)
    finally:
        procs.stop().get(timeout=60)
    assert group.check_consistency() is None


def test_a_replacement_goes_on_with_the_groups_batches_and_random_numbers(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """Against a run without failures: replica 1 is killed between steps 2 and 3, replica 2
    dies in the forward pass of step 4 (the survivors retry it with the gradients they kept).
    Every replica reads, at every step it commits, the batch and the random numbers the run
    without failures read there."""
    reference = ReplicaGroup(this_host(), ha.LoaderTrainer, {}, str(tmp_path), replicas=3)
    groups.append(reference)
    train(reference, 7)
    expected = _committed_reads(reference)
    assert len(expected) == 21 and len({e for e in expected.values()}) == 21, expected
    reference.close()
    plan = {2: [(4, "forward")]}
    group = ReplicaGroup(
        this_host(), ha.LoaderTrainer, plan, str(tmp_path), replicas=3, heartbeat_timeout_s=HB
    )
    groups.append(group)
    train(group, 7, between={2: 1}, full_before={4, 5})
    # step 4 retried by the survivors; the dead replica's replacement may be in the retry too,
    # if it was healed and caught up by the retry's start (or joined it in flight)
    assert group.history[3] in {(4, (0, 1)), (4, (0, 1, 2))}, group.history
    assert {r.replica for r in group.recoveries} == {1, 2}, group.recoveries
    reads = _committed_reads(group)
    for (replica, step), read in reads.items():
        assert read == expected[(replica, step)], (replica, step, read)
    steps_read = {r: sorted(s for q, s in reads if q == r) for r in (0, 1, 2)}
    # Replica 1's replacement takes part from step 3 when its death was heard only once step 3
    # had started (step 3 is then discarded and tried again) and it healed before the retry.
    assert steps_read[1] in ([3, 4, 5, 6, 7], [4, 5, 6, 7]), steps_read
    # Replica 2's replacement likewise takes part in the retry of step 4 if it was ready by then.
    assert steps_read[2] in ([4, 5, 6, 7], [5, 6, 7]), steps_read
    assert steps_read == {0: [1, 2, 3, 4, 5, 6, 7], 1: steps_read[1], 2: steps_read[2]}, steps_read
    retried = [e for e in group.replicas[0].seen_batches.call_one().get(60) if e[0] == 4]
    # the survivors keep their gradient of the discarded step: its retry reads nothing again
    assert len(retried) == 1, retried


def _committed_reads(group: ReplicaGroup) -> dict[tuple[int, int], tuple[tuple[int, ...], float]]:
    """(replica, step) -> (batch ids, noise) of the attempt that committed, steps 1 to 7."""
    committed = dict(group.history)
    reads = {}
    for replica in group.live():
        for step, ids, noise in group.replicas[replica].seen_batches.call_one().get(60):
            if step <= 7 and replica in committed.get(step, ()):
                reads[(replica, step)] = (ids, noise)  # the last attempt is the one committed
    return reads


def _overtaken_heal(
    groups: list[ReplicaGroup], tmp_path: Path, actor: type, commits: int
) -> tuple[ReplicaGroup, HealReport]:
    """A group of 3 `actor` replicas trained 2 steps, whose replica 1 is killed and its
    replacement's heal held (at the point `actor` holds it) while `commits` steps commit;
    then the heal goes on, with no step meanwhile: (the group, the heal's report)."""
    hold = tmp_path / "hold"
    group = ReplicaGroup(this_host(), actor, str(hold), replicas=3, heartbeat_timeout_s=HB)
    groups.append(group)
    train(group, 2)
    hold.touch()
    os.kill(pid_of(group, 1), signal.SIGKILL)
    _wait_for(hold.with_suffix(".asked").exists, "the replacement never asked for its state")
    committed = 0
    while committed < commits:  # commits overtake the heal under way
        committed += group.step().committed
    hold.unlink()
    return group, _healed(group, 1)


@pytest.mark.parametrize("drifts", [False, True], ids=["plain", "scheduled"])
def test_a_heal_that_a_commit_overtakes_keeps_what_it_fetched_and_replays_the_update(
    groups: list[ReplicaGroup], tmp_path: Path, drifts: bool
) -> None:
    """A commit overtakes a heal that holds the first parameter and its optimizer state of
    step 2 and part of the next: the donors keep nothing (they answer `Stale`), the heal
    fetches the rest at step 3 and applies step 3's update to that first parameter alone, in
    the same call. The replacement holds step 3 with the donors' bits, without a step of the
    group, also when a schedule sets the learning rate at each apply (the replay uses step
    3's), and the run equals a replay."""
    actor = ha.HeldAfterFirstChunkScheduled if drifts else ha.HeldAfterFirstParameter
    group, report = _overtaken_heal(groups, tmp_path, actor, commits=1)
    assert (report.step, report.starts, report.updates) == (3, 2, 1), report
    held = group.replicas[1].status.call_one().get(timeout=30)
    theirs = group.replicas[0].status.call_one().get(timeout=30)
    assert held == theirs and held[0] == group.committed_steps == 3
    assert report.digest == held[1]  # for the group to check
    train_until_recovered(group)
    assert group.live() == (0, 1, 2)
    assert group.replicas[1].heal_report.call_one().get(timeout=30) == report  # no 2nd heal
    train(group, group.committed_steps + 1)
    if drifts:  # the replay knows no schedule: the replicas agree
        assert group.check_consistency() is None
    else:
        assert_invariants(group)


def _healed(group: ReplicaGroup, replica: int) -> HealReport:
    """The report of `replica`'s heal, once it healed."""
    _wait_for(
        lambda: group.replicas[replica].heal_report.call_one().get(timeout=30) is not None,
        "the replacement never healed",
    )
    return group.replicas[replica].heal_report.call_one().get(timeout=30)  # type: ignore[no-any-return]


def test_a_heal_two_steps_behind_fetches_again_what_it_held(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """Two commits overtake a heal that holds the first parameter of step 2: two steps behind
    (`REPLAY_BEHIND` is 1; at model scale a fetch is cheaper than two optimizer steps), the
    heal fetches it again at step 4 with the rest instead of replaying two updates on it,
    in the same call; the replacement joins without a step of catch-up, and the run equals
    a replay."""
    group, report = _overtaken_heal(groups, tmp_path, ha.HeldAfterFirstParameter, commits=2)
    assert (report.step, report.starts, report.updates) == (4, 2, 0), report
    assert group.committed_steps == 4
    held = group.replicas[1].status.call_one().get(timeout=30)
    assert held == group.replicas[0].status.call_one().get(timeout=30)
    train_until_recovered(group)
    assert group.live() == (0, 1, 2)
    train(group, group.committed_steps + 1)
    assert_invariants(group)


@pytest.mark.parametrize("commits", [1, 3])
def test_a_heal_overtaken_before_its_first_chunk_goes_on_at_the_newest_step(
    groups: list[ReplicaGroup], tmp_path: Path, commits: int
) -> None:
    """Commits overtake a heal that has its layout and nothing else: every donor answers
    `Stale`, and the heal goes on at the newest committed step in the same call, into the
    memory it made, instead of failing (which cost a step boundary and a heal from scratch:
    the first heal "refused" at 100 MB)."""
    group, report = _overtaken_heal(groups, tmp_path, ha.HeldAtFirstChunk, commits)
    assert (report.starts, report.step, report.updates) == (2, 2 + commits, 0), report
    held = group.replicas[1].status.call_one().get(timeout=30)
    assert held == group.replicas[0].status.call_one().get(timeout=30)
    assert held[0] == group.committed_steps == 2 + commits
    train_until_recovered(group)
    assert group.live() == (0, 1, 2)
    train(group, group.committed_steps + 1)
    assert_invariants(group)
