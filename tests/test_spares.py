"""Hot spares of a `ReplicaGroup` (`spares=K`): standby replicas follow the committed steps and
take a failed replica's place at the next step; a spare that dies is replaced and the steps do
not notice. Real procs, gloo and SIGKILL; the invariants are those of tests/test_replicas.py.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import heal_actors as ha
import pytest
import replica_actors as ra
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_heal import _committed_reads
from test_replicas import assert_invariants, pid_of, train, train_until_recovered

from mesh import ActorMesh, this_host
from mesh.testing import probe
from recovery import Replica, ReplicaGroup, UpdateLog, replay_training
from recovery import parameter_digest as digest
from recovery.testing import AbortNotices, AbortWatch, StoreServer, form_groups
from supervision import SupervisionError
from transport import dumps, loads

pytestmark = pytest.mark.timeout(240)

HB = 1.0


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _pid(mesh: ActorMesh[Replica]) -> int:
    return int(next(iter(probe(mesh).get(timeout=30).values())))


def assert_spares_follow(group: ReplicaGroup) -> None:
    """Every spare holds, bit for bit, the state of a committed step (the replay up to it)."""
    for mesh in group.spare_replicas:
        for step, held in mesh.status.call().get(timeout=60).values():
            assert 0 < step <= group.committed_steps, (step, group.committed_steps)
            assert held == digest(replay_training(ra.Trainer, group.history[:step])), step


def test_spares_take_the_place_of_dead_replicas_and_dead_spares_are_replaced(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """Replica 1 dies in the exchange of step 3, replica 0 is killed between steps 5 and 6:
    each time a spare takes the place, in the step in flight (step 3 is completed, not
    discarded) or at the next step, so every step is committed by all three. Then the spare
    itself is killed: no step notices."""
    plan = {1: [(3, "allreduce")]}
    group = _with_a_ready_spare(groups, ra.DyingTrainer, plan, tmp_path)
    first_spare = group.spare_replicas[0]
    train(group, 8, between={5: 0}, full_before={6})
    assert [(r.replica, r.by_spare) for r in group.recoveries] == [(1, True), (0, True)]
    assert all(r.first_commit_at is not None for r in group.recoveries), group.recoveries
    assert group.replicas[1] is first_spare, "the first spare holds replica 1's place"
    assert all(members == (0, 1, 2) for _, members in group.history), group.history
    discarded = [o.step for o in group.outcomes if not o.committed]
    assert 3 not in discarded and len(discarded) == len(set(discarded)), group.outcomes
    assert_invariants(group)

    group.wait_for_all()  # the spare spawned after the second take-over is ready
    spare = group.spare_replicas[0]
    outcomes = len(group.outcomes)
    os.kill(_pid(spare), signal.SIGKILL)
    _wait_for(lambda: group.ready_spares() == 0, "the group never noticed the spare's death")
    train(group, 10)
    group.wait_for_all()  # re-spawned in place and healed
    train(group, 12)
    assert group.spare_replicas == [spare] and group.ready_spares() == 1
    assert all(o.committed for o in group.outcomes[outcomes:]), group.outcomes[outcomes:]
    assert len(group.recoveries) == 2, "a spare's death is no replica's failure"
    assert any(e.mesh_name.startswith("replica-spare") for e in group.events), group.events
    assert_invariants(group)
    assert_spares_follow(group)


def test_a_new_spare_heals_while_the_group_steps_and_takes_over_at_its_bits(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """After a take-over, the new spare's heal is held (the donors send no chunk): the group
    goes on committing steps meanwhile, with no spare ready. Released, the heal (overtaken by
    those commits) makes the spare ready at the group's bits, and its take-over of the next
    dead replica ends at the replay's bits. Spares build without random initialisation (they
    heal every tensor); the replicas the group starts with do not."""
    hold = tmp_path / "hold-heals"
    group = ReplicaGroup(
        this_host(), ra.HeldHeals, str(hold), replicas=3, spares=1, heartbeat_timeout_s=HB
    )
    groups.append(group)
    try:
        group.wait_for_all()
        skipped = [m.skipped_init.call_one().get(timeout=30) for m in group.replicas]
        assert skipped == [False] * 3
        assert group.spare_replicas[0].skipped_init.call_one().get(timeout=30)
        train(group, 3)
        hold.touch()
        os.kill(pid_of(group, 1), signal.SIGKILL)
        _wait_for(lambda: len(group.recoveries) == 1, "the kill is noticed")
        train_until_recovered(group)
        assert group.recoveries[0].by_spare, group.recoveries
        _wait_for(
            lambda: (group.step(), hold.with_suffix(".asked").exists())[1],
            "the new spare never asked for its state",
        )
        held_at = group.committed_steps
        train(group, held_at + 3)  # while its heal is held
        assert group.ready_spares() == 0
        assert not hold.with_suffix(".expired").exists(), "a step waited for the spare's heal"
    finally:
        hold.unlink(missing_ok=True)
    group.wait_for_all()
    assert_spares_follow(group)
    assert group.spare_replicas[0].skipped_init.call_one().get(timeout=30)
    os.kill(pid_of(group, 0), signal.SIGKILL)
    _wait_for(lambda: len(group.recoveries) == 2, "the second kill is noticed")
    train_until_recovered(group)
    assert [r.by_spare for r in group.recoveries] == [True, True], group.recoveries
    assert_invariants(group)


def test_a_spare_killed_while_following_is_replaced_and_no_step_waits(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """The spare dies as it starts to follow the group (a call the steps do not wait for):
    every step is committed by the three replicas, no recovery is recorded, and the spare
    re-spawned in its place follows the group bit for bit again."""
    group = _with_a_ready_spare(groups, ra.DiesFollowing, {}, tmp_path)
    spare = group.spare_replicas[0]
    _wait_for(
        lambda: (group.step(), (tmp_path / "died-following").exists())[1],
        "the spare never followed the group",
    )
    _wait_for(lambda: group.ready_spares() == 0, "the group never noticed the spare's death")
    outcomes = len(group.outcomes)
    train(group, group.committed_steps + 4)
    group.wait_for_all()  # re-spawned in place and healed
    train(group, group.committed_steps + 6)
    assert group.spare_replicas == [spare] and group.ready_spares() == 1
    assert all(o.committed for o in group.outcomes[outcomes:]), group.outcomes[outcomes:]
    assert group.recoveries == [], "a spare's death is no replica's failure"
    assert all(members == (0, 1, 2) for _, members in group.history), group.history
    assert_invariants(group)
    assert_spares_follow(group)


def test_a_spare_a_whole_log_behind_takes_over_at_exactly_the_groups_state(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """The spare follows at nice 19 (where the process may raise it back; at its own
    priority when it lags) and lags: asked to reach step 8 (from 4, or later), it is still at
    it when replica 1 dies 4 steps later, up to 8 updates (its peers' whole log) behind. The
    take-over raises the follow under way to its own priority, waits for it, applies the
    rest, and the group goes on with the replay's bits; no thread of the new replica stays at
    a low priority."""
    group = _with_a_ready_spare(groups, ra.LagsFollowing, {}, tmp_path)
    spare = group.spare_replicas[0]
    train(group, 8)
    _wait_for(
        lambda: (group.step(), (tmp_path / "following").exists())[1],
        "the spare never followed step 8",
    )
    train(group, group.committed_steps + 4)  # its follow still under way
    os.kill(pid_of(group, 1), signal.SIGKILL)
    train_until_recovered(group)
    train(group, group.committed_steps + 2)
    assert [(r.replica, r.by_spare) for r in group.recoveries] == [(1, True)], group.recoveries
    assert group.replicas[1] is spare
    assert_invariants(group)
    pid = _pid(spare)
    threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in threads} == {0}
    noted = set((tmp_path / "follow-nice").read_text().split())
    assert noted <= {"0", "19"} and (os.geteuid() != 0 or "19" in noted), noted


def test_a_spare_starved_of_cpu_fetches_the_updates_before_its_peers_drop_them(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """The spare's follow of step 4 gets no CPU for 3 s while the group commits 7 more steps:
    its peers (8 updates each) no longer keep the updates of steps 3 and 4 when it runs again.
    It fetched them when it was asked, so it catches up from them: it is not healed whole,
    and holds the committed bits."""
    group = _with_a_ready_spare(groups, ra.StarvedFollowing, {}, tmp_path)
    spare = group.spare_replicas[0]
    healed = spare.last_healed.call_one().get(timeout=30)
    train(group, 4)
    _wait_for((tmp_path / "held").exists, "the spare never followed step 4")
    held = int((tmp_path / "held").read_text())
    train(group, held + 7)  # while its follow is held
    _wait_for((tmp_path / "released").exists, "the spare's follow was never released")
    _wait_for(lambda: spare.status.call_one().get(timeout=30)[0] >= held, "the spare never applied")
    _wait_for(
        lambda: (group.step(), spare.status.call_one().get(timeout=30)[0] > held + 7)[1],
        "the spare never caught up",
    )
    assert spare.last_healed.call_one().get(timeout=30) == healed
    group.wait_for_all()
    assert group.ready_spares() == 1
    assert_spares_follow(group)


def test_a_spare_that_cannot_follow_is_healed_never_trusted(groups: list[ReplicaGroup]) -> None:
    """The replicas' state changes outside the updates a spare applies: its digest never
    matches the group's, so it is healed whole again and again. A replica's failure is then
    recovered by the spare (healed at the take-over unless it holds the step's bits) or, if
    the spare is being healed, by a re-spawn: either way the replicas end equal, and the
    spare is ready again (only a heal makes it so)."""
    group = ReplicaGroup(
        this_host(), ra.DriftsOutsideGradient, replicas=3, spares=1, heartbeat_timeout_s=HB
    )
    groups.append(group)
    group.wait_for_all()
    train(group, 7)
    os.kill(pid_of(group, 1), signal.SIGKILL)
    _wait_for(lambda: len(group.recoveries) == 1, "the kill is noticed")
    train_until_recovered(group)
    train(group, group.committed_steps + 2)
    assert group.recoveries[0].first_commit_at is not None, group.recoveries
    assert group.check_consistency() is None
    held = {d for entries in group.status().values() for _, d in entries}
    assert len(held) == 1, f"the replicas differ after the recovery: {held}"
    group.wait_for_all()
    assert group.ready_spares() == 1


def test_a_spare_goes_on_with_the_groups_batches_and_random_numbers(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """Against a run without failures: replica 1 is killed between steps 2 and 3 and a spare
    takes its place. At every step, every replica reads the batch and the random numbers the
    run without failures read, and the parameters end equal to that run's, bit for bit."""
    expected, final = _loader_run_without_failures(groups, tmp_path)
    group = _with_a_ready_spare(groups, ha.LoaderTrainer, {}, tmp_path)
    train(group, 7, between={2: 1})
    assert [(r.replica, r.by_spare) for r in group.recoveries] == [(1, True)], group.recoveries
    assert all(members == (0, 1, 2) for _, members in group.history), group.history
    reads = _committed_reads(group)
    assert set(reads) == set(expected) - {(1, 1), (1, 2)}, sorted(reads)  # 1 died after 2
    for key, read in reads.items():
        assert read == expected[key], (key, read)
    assert group.status() == final


@settings(max_examples=200, deadline=None)
@given(
    keep=st.integers(0, 5),
    steps=st.lists(st.integers(1, 3), max_size=12),  # each: how far after the previous one
    first=st.integers(1, 30),
    count=st.integers(1, 6),
)
def test_the_update_log_gives_exactly_the_kept_run_of_steps(
    keep: int, steps: list[int], first: int, count: int
) -> None:
    """A replica keeps the updates of its last `keep` committed steps in a row (a gap, as after
    a heal, starts afresh), and gives steps first..last only if it keeps every one of them."""
    log = UpdateLog()
    log.resize(keep)
    step, run = 0, []
    for gap in steps:
        step += gap
        log.record(step, torch.full((1,), float(step)))
        run = (run if run and run[-1] == step - 1 else []) + [step]
    kept = run[-keep:] if keep else []
    last = first + count - 1
    found = log.between(first, last)
    if all(s in kept for s in range(first, last + 1)):
        assert found is not None and [int(u.item()) for u in found] == list(range(first, last + 1))
    else:
        assert found is None


@settings(max_examples=100, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
    numel=st.integers(0, 5000),
    first=st.integers(1, 3),
)
def test_lent_updates_arrive_bit_for_bit(dtype: torch.dtype, numel: int, first: int) -> None:
    """The updates a replica lends a spare (sent from its memory, no copy) arrive as flat
    tensors of the same dtype and bits, through the transport's own serialization."""
    log = UpdateLog()
    log.resize(3)
    for step in (1, 2, 3):
        log.record(step, (torch.randn(numel, dtype=torch.float64) * step).to(dtype))
    lent = log.lend(first, 3)
    assert lent is not None and log.lend(first, 4) is None  # step 4 was never kept
    body, buffers = dumps(lent)
    received = loads(body, buffers)
    kept = log.between(first, 3)
    assert kept is not None and len(received) == len(kept)
    for got, want in zip(received, kept, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))


@settings(max_examples=200, deadline=None)
@given(
    keep=st.integers(1, 4),
    actions=st.lists(st.sampled_from(["commit", "commit", "let go", 0, 1, 2, 3]), max_size=30),
)
def test_the_update_log_hands_back_exactly_the_memory_no_one_reads(
    keep: int, actions: list[str | int]
) -> None:
    """`record` hands back, for the next step's update to be written into, the update that
    left the log, exactly when no lend of it to the transport is still held (a spare may be
    reading it): so no fresh memory per step, and never memory a spare still reads."""
    log = UpdateLog()
    log.resize(keep)
    updates: dict[int, torch.Tensor] = {}
    held: list[tuple[object, list[torch.Tensor]]] = []  # (what the transport holds, its updates)
    for action in actions:
        if action == "commit":
            step = len(updates) + 1
            updates[step] = torch.full((4,), float(step))
            handed = log.record(step, updates[step])
            left = updates.get(step - keep)
            read = any(left is t for _, tensors in held for t in tensors)
            if left is None or read:
                assert handed is None
            else:
                assert handed is left, "the update that left the log, no one reading it"
        elif action == "let go":
            held.clear()  # the transport sent them
        elif isinstance(action, int) and updates:
            last = len(updates)
            first = max(1, last - action)
            lent = [updates[s] for s in range(first, last + 1)] if first > last - keep else []
            held.append((dumps(log.lend(first, last)), lent))  # held by the frames only


def test_the_update_log_hands_out_the_memory_provided_while_it_fills() -> None:
    """A replica of a group with spares is given its update log's memory when configured: each
    step before the log is full writes into some of it (not into fresh memory), each piece
    once, and never into an update the log keeps."""
    log = UpdateLog()
    log.resize(3)
    provided = [torch.zeros(4) for _ in range(5)]  # more than kept: the rest is not used
    log.provide(provided)
    updates = [torch.full((4,), float(step)) for step in range(1, 7)]
    handed = [log.record(step, update) for step, update in enumerate(updates, start=1)]
    assert all(any(h is p for p in provided) for h in handed[:3])
    assert len({id(h) for h in handed[:3]}) == 3
    assert handed[3:] == [updates[0], updates[1], updates[2]]  # then what left the log


class FollowsTooRarely(ra.Trainer):
    standby_updates = 4
    standby_follow_every = 3  # its peers would no longer keep what it lacks


def test_bad_spare_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="spares must be a whole number"):
        ReplicaGroup(this_host(), ra.Trainer, replicas=2, spares=-1)
    with pytest.raises(ValueError, match="from 1 to half its standby_updates"):
        ReplicaGroup(this_host(), FollowsTooRarely, replicas=2, spares=1)
    log = UpdateLog()
    with pytest.raises(ValueError, match=r"first\.\.last >= 1"):
        log.between(3, 2)
    with pytest.raises(ValueError, match="whole number of updates"):
        log.resize(-1)


def test_without_spares_replicas_keep_no_updates(groups: list[ReplicaGroup]) -> None:
    group = ReplicaGroup(this_host(), ra.Trainer, replicas=2)
    groups.append(group)
    train(group, 2)
    assert group.spare_replicas == [] and group.ready_spares() == 0
    kept = group.replicas[0].committed_updates.call_one(1, 2).get(timeout=60)
    assert kept is None, "a group without spares spends no memory on updates"
    os.kill(pid_of(group, 1), signal.SIGKILL)
    train(group, 4)
    assert [(r.replica, r.by_spare) for r in group.recoveries] == [(1, False)]


def test_a_spare_of_several_ranks_takes_the_place_of_a_replica_losing_one(
    groups: list[ReplicaGroup],
) -> None:
    group = ReplicaGroup(
        this_host(),
        ra.Trainer,
        replicas=2,
        per_replica={"gpus": 2},
        spares=1,
        heartbeat_timeout_s=HB,
    )
    groups.append(group)
    group.wait_for_all()
    train(group, 3)
    old = group.replicas[1]
    os.kill(_pid(old.slice(gpus=1)), signal.SIGKILL)  # one rank of two
    train(group, 6)
    assert [(r.replica, r.by_spare) for r in group.recoveries] == [(1, True)]
    assert all(members == (0, 1) for _, members in group.history), group.history
    assert_invariants(group, ranks_per_replica=2)
    _wait_for(lambda: _stopped(old.slice(gpus=0)), "the old replica's rank 0 was not stopped")


def _stopped(mesh: ActorMesh[Replica]) -> bool:
    try:
        mesh.status.call_one().get(timeout=30)
    except SupervisionError as error:
        return "stop" in str(error)
    return False


def test_a_take_over_needs_no_rendezvous_and_a_kill_right_after_it_is_recovered(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """Replica 2 would die if it joined a process group at step 3 or 9: the take-overs there
    complete the step in groups formed in advance. Replica 1 dies in the exchange of step 3;
    the spare taking its place dies as it commits that step (the step stands; replica 1 is
    re-spawned and healed). Replica 0 dies in the exchange of step 9: the new spare takes its
    place, again without a rendezvous. The bits equal the replay's throughout."""
    plan = {
        0: [(9, "allreduce")],
        1: [(3, "allreduce"), (3, "commit")],
        2: [(3, "join"), (9, "join")],
    }
    group = _with_a_ready_spare(groups, ra.DyingTrainer, plan, tmp_path)
    train(group, 3)
    assert group.history[2] == (3, (0, 1, 2)), group.history
    train(group, 10, full_before={8})  # step 8 forms the group of all: step 9 has it
    assert [(r.replica, r.by_spare) for r in group.recoveries] == [
        (1, True),
        (1, False),
        (0, True),
    ], [(r.replica, r.by_spare, r.event[-60:]) for r in group.recoveries]
    assert group.history[8] == (9, (0, 1, 2)), group.history
    discarded = [o.step for o in group.outcomes if not o.committed]
    assert 3 not in discarded and 9 not in discarded, group.outcomes  # completed by spares
    first_commits = [r.first_commit_at is not None for r in group.recoveries]
    assert first_commits == [False, True, True], "the first spare died before its first commit"
    assert_invariants(group)
    group.wait_for_all()  # the spare spawned after the second take-over is healed
    assert_spares_follow(group)


def test_a_death_while_committing_leaves_the_step_its_digest_and_the_spare_is_not_healed(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """Replica 1 dies as it commits step 4, whose digest the participants share (no check is
    due): its share is made up from a survivor, so the spare, which hashes at step 4, and
    takes replica 1's place at step 5, is found holding step 4's bits: it catches up on the
    updates, never heals its whole state again (its last heal is the one it started with)."""
    group = _with_a_ready_spare(groups, ra.HealsNoted, {1: [(4, "commit")]}, tmp_path)
    spare = group.spare_replicas[0]
    healed = spare.last_healed.call_one().get(timeout=30)
    train(group, 6)
    assert [(r.replica, r.by_spare) for r in group.recoveries] == [(1, True)], group.recoveries
    assert group.history[3] == (4, (0, 1, 2)), group.history  # decided: it stands
    assert group.replicas[1].last_healed.call_one().get(timeout=30) == healed
    assert_invariants(group)


def test_take_overs_in_a_row_leave_the_spare_ready_with_its_groups_formed(
    groups: list[ReplicaGroup],
) -> None:
    """Three take-overs in a row, each as soon as the new spare is ready: every time the groups
    of the next take-overs form (wait_for_all), and the bits equal the replay's."""
    group = ReplicaGroup(this_host(), ra.Trainer, replicas=3, spares=1, heartbeat_timeout_s=HB)
    groups.append(group)
    group.wait_for_all()
    for kills, victim in enumerate((1, 0, 1), 1):
        train(group, group.committed_steps + 2)
        os.kill(pid_of(group, victim), signal.SIGKILL)
        _wait_for(lambda: len(group.recoveries) == kills, "the kill is noticed")  # noqa: B023
        train_until_recovered(group)
        group.wait_for_all()
    assert [r.by_spare for r in group.recoveries] == [True] * 3, group.recoveries
    assert_invariants(group)


def test_steps_go_on_while_a_spares_groups_form_and_a_take_over_meanwhile_rendezvouses(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """The spare's formation of its take-overs' groups is held (its `stand_by` waits for a
    file; the group gives a formation 160 s): the step that finds the spare ready and the
    steps after it go on beside the formation, none waits for it. Replica 1 is killed
    meanwhile: the spare takes its place through a fresh rendezvous (its group is not formed),
    and the bits equal a fault-free run's. The new spare is ready before the formation ends:
    no second formation starts meanwhile. Released, the formation ends and the new spare's
    groups form."""
    hold, asked = tmp_path / "hold", tmp_path / "hold.asked"
    hold.touch()
    group = ReplicaGroup(
        this_host(), ra.HeldStandBy, str(hold), replicas=3, spares=1, heartbeat_timeout_s=HB,
        group_timeout_s=40.0,
    )  # fmt: skip
    groups.append(group)
    _wait_for(lambda: (group.step(), group.ready_spares() == 1)[1], "the spare is never ready")
    _wait_for(asked.exists, "no formation was asked of the spare")
    train(group, group.committed_steps + 3)
    os.kill(pid_of(group, 1), signal.SIGKILL)
    _wait_for(lambda: len(group.recoveries) == 1, "the kill is noticed")
    train(group, group.committed_steps + 3)
    _wait_for(lambda: (group.step(), group.ready_spares() == 1)[1], "no new spare is ready")
    train(group, group.committed_steps + 3)
    assert not hold.with_suffix(".timed-out").exists(), "a step waited for the formation"
    assert len(asked.read_text().split()) == 1, "a formation started beside the one under way"
    assert [(r.replica, r.by_spare) for r in group.recoveries] == [(1, True)], group.recoveries
    assert all(members == (0, 1, 2) for _, members in group.history), group.history
    assert_invariants(group)
    hold.unlink()
    group.wait_for_all()  # the held formation ends, the new spare's groups form
    train(group, group.committed_steps + 2)
    assert_invariants(group)


def test_a_formation_given_up_ends_at_once_and_a_failed_one_releases_its_peers() -> None:
    """A participant that comes late to a standing formation the controller gave up (its
    queue held an older call) skips it without waiting; one whose rendezvous fails marks the
    other groups of its formation aborted, so that their participants stop waiting for it."""
    server = StoreServer()
    store = server.addresses
    try:
        AbortNotices(store, 5.0).abort(7, "its formation failed; a new one is tried")
        # skipped before its rendezvous starts (none is left behind, waiting)
        assert form_groups({}, [(7, 0, 2)], 0, store, 5.0) == {}, "a given-up group is skipped"
        with pytest.raises(Exception, match=r"(?i)timeout|timed out"):
            form_groups({}, [(9, 0, 2), (10, 0, 2)], 0, store, 1.0)  # nobody else comes
        watch = AbortWatch(store, 5.0)
        for quorum in (9, 10):
            watch.quorum = quorum
            assert "could not form it" in (watch() or ""), quorum
    finally:
        server.close()


def _loader_run_without_failures(groups: list[ReplicaGroup], tmp_path: Path) -> tuple[Any, Any]:
    """What three `LoaderTrainer` replicas read in 7 steps without failures, and their final
    status: the reference for runs with failures."""
    reference = ReplicaGroup(this_host(), ha.LoaderTrainer, {}, str(tmp_path), replicas=3)
    groups.append(reference)
    train(reference, 7)
    expected = _committed_reads(reference)
    final = reference.status()
    reference.close()
    return expected, final


def _with_a_ready_spare(
    groups: list[ReplicaGroup], trainer: type[Any], plan: dict[int, Any], tmp_path: Path
) -> ReplicaGroup:
    """Three replicas of `trainer` (its death `plan`, files in `tmp_path`) and one spare, once
    the spare is ready and the groups of its take-overs are formed."""
    group = ReplicaGroup(
        this_host(), trainer, plan, str(tmp_path), replicas=3, spares=1, heartbeat_timeout_s=HB
    )
    groups.append(group)
    group.wait_for_all()
    return group
