"""A replacement heals while the survivors go on stepping, and joins a later step.

The donors of the test's heal send nothing while a file exists, so the heal lasts as long as
the test wants: the survivors must commit steps meanwhile (no wait for a spawn or a heal),
and once the heal goes through, the replacement catches up on the steps committed since and
takes part, with parameters equal to a single-process replay of the run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import replica_actors as ra
import torch
from test_replicas import HB, assert_invariants, pid_of, train, train_until_recovered

from mesh import this_host
from recovery import ReplicaGroup, UpdateLog

pytestmark = pytest.mark.timeout(180)


def test_survivors_step_while_a_replacement_heals_and_it_joins_later(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    hold = tmp_path / "hold-heals"
    group = ReplicaGroup(this_host(), ra.HeldHeals, str(hold), replicas=3, heartbeat_timeout_s=HB)
    groups.append(group)
    try:
        for _ in range(3):
            group.step()
        hold.touch()
        os.kill(pid_of(group, 1), signal.SIGKILL)
        asked = hold.with_suffix(".asked")  # the replacement runs and asked for its state
        meanwhile = 0  # steps committed since, while it was not yet healed
        for _ in range(200):
            up = asked.exists()
            outcome = group.step()
            if up and outcome.committed and 1 not in group.live():
                meanwhile += 1
            if meanwhile >= 3:
                break
        assert meanwhile >= 3, group.outcomes[-5:]
        assert group.live() == (0, 2)
    finally:
        hold.unlink(missing_ok=True)
    for _ in range(200):
        if group.live() == (0, 1, 2):
            break
        group.step()
    assert group.live() == (0, 1, 2), group.outcomes[-5:]
    for _ in range(2):
        assert group.step().committed
    assert group.history[-1] == (group.committed_steps, (0, 1, 2))
    healed_to = group.replicas[1].healed_to.call().get(timeout=30)
    print(
        f"\nreplacement healed to step {list(healed_to.values())}, joined after {meanwhile} steps"
    )
    assert_invariants(group)


def _new_build(marks: Path, known: set[int], timeout_s: float = 60.0) -> int:
    """The pid of a replica built since `known` (waited for, without stepping the group)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        built = {int(path.name.split("-")[1]) for path in marks.glob("built-*")}
        if built - known:
            return min(built - known)
        time.sleep(0.01)
    raise AssertionError(f"no replacement was built within {timeout_s:g} s: {sorted(known)}")


def test_a_replacement_is_spawned_as_soon_as_the_failure_is_heard(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """The supervision handler re-spawns a failed replica at once: its replacement runs while
    the controller is not stepping. A kill of that replacement while it starts and heals is
    a failure like any other: the next one takes its place, and the invariants hold. A
    replacement skips random initialisations (it heals every tensor), the others do not."""
    group = ReplicaGroup(
        this_host(), ra.Announced, str(tmp_path), replicas=3, heartbeat_timeout_s=HB
    )
    groups.append(group)
    train(group, 2)
    known = {pid_of(group, index) for index in range(3)}
    os.kill(pid_of(group, 1), signal.SIGKILL)
    replacement = _new_build(tmp_path, known)  # no step() since the kill
    assert [r.replica for r in group.recoveries] == [1]
    os.kill(replacement, signal.SIGKILL)  # while it builds or heals
    train(group, 4)
    train_until_recovered(group)
    assert group.live() == (0, 1, 2)
    assert pid_of(group, 1) not in known | {replacement}
    skipped = [group.replicas[i].skipped_init.call_one().get(timeout=30) for i in range(3)]
    assert skipped == [False, True, False], "a replacement builds without random init"
    assert_invariants(group)


def test_a_replacement_live_before_the_next_step_gets_a_fresh_process_group(
    groups: list[ReplicaGroup],
) -> None:
    """Replica 1 is killed between two steps and its replacement (spawned from the handler)
    is live before the next one: the same replica ids on a new process, so that step forms a
    new process group instead of using the one the dead replica was in, and commits."""
    group = ReplicaGroup(this_host(), ra.Trainer, replicas=2, heartbeat_timeout_s=HB)
    groups.append(group)
    train(group, 2)
    os.kill(pid_of(group, 1), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not group.recoveries:
        assert time.monotonic() < deadline, "the kill is noticed"
        time.sleep(0.02)
    group.wait_for_all()  # replaced and healed, without a step
    outcome = group.step()
    assert outcome.committed, outcome
    assert_invariants(group)


def test_a_replacement_joins_the_step_in_flight_once_it_holds_the_committed_state(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """The survivors are in step 3 (held before its exchange) when the replacement of replica 1
    ends its heal: it joins step 3 at once. The survivors give their exchange up and redo it
    with it, each with the gradient it had (one forward pass each: the replacement's computed
    ahead, as it waited, on the thread that warmed it up, not after the group formed); the step
    commits with the three replicas and the run equals a replay."""
    hold = tmp_path / "hold"
    held = hold.with_suffix(".exchange")
    group = ReplicaGroup(
        this_host(), ra.HeldExchanges, str(hold), replicas=3, heartbeat_timeout_s=HB
    )
    groups.append(group)
    train(group, 2)
    outcomes = []
    stepping = threading.Thread(target=lambda: outcomes.append(group.step()))
    try:
        hold.touch()  # the donors hold the replacement's heal
        held.touch()  # and themselves before step 3's exchange
        os.kill(pid_of(group, 1), signal.SIGKILL)
        _wait(lambda: 1 not in group.live() and hold.with_suffix(".asked").exists(), "healing")
        stepping.start()
        _wait(hold.with_suffix(".waiting").exists, "the survivors never reached the exchange")
        hold.unlink()  # the heal goes through while step 3 is in flight
        _wait(lambda: 1 in group.live(), "the replacement never joined")
    finally:
        hold.unlink(missing_ok=True)
        held.unlink(missing_ok=True)
        stepping.join(timeout=120)
    assert [(o.step, o.committed, o.participants) for o in outcomes] == [(3, True, (0, 1, 2))]
    assert group.history[-1] == (3, (0, 1, 2)) and group.recoveries[-1].in_flight
    forwards = [line.split() for line in hold.with_suffix(".forwards").read_text().splitlines()]
    of_step_3 = {
        replica: [t for r, step, t in forwards if (r, step) == (str(replica), "3")]
        for replica in range(3)
    }
    assert [len(threads) for threads in of_step_3.values()] == [1, 1, 1], forwards
    assert of_step_3[1] == ["replica-warm-up"], forwards
    train(group, 5)
    assert_invariants(group)


def _wait(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_replacement_that_healed_a_step_behind_catches_up_beside_the_step_and_joins_it(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """The replacement of replica 1 takes each data position (its heal's end, each update its
    own catch-up applies) only once the group committed another step, so its heal ends a step
    behind the group. The next step does not wait for its catch-up: it catches up beside it
    while the survivors are held before their exchange, and joins that step in flight. The
    step commits with the three replicas and the run equals a replay."""
    hold = tmp_path / "hold"
    held = hold.with_suffix(".exchange")
    group = ReplicaGroup(this_host(), ra.HeldLoads, str(hold), replicas=3, heartbeat_timeout_s=HB)
    groups.append(group)
    train(group, 2)
    os.kill(pid_of(group, 1), signal.SIGKILL)
    _wait(lambda: bool(group.recoveries), "the kill was never noticed")
    recovery = group.recoveries[-1]
    outcomes = []
    stepping = threading.Thread(target=lambda: outcomes.append(group.step()))
    try:
        loads = 0
        while recovery.respawned_at is None:  # its heal, caught up, has not ended yet
            if hold.with_suffix(f".loading-{loads + 1}").exists():
                loads += 1
                assert group.step().committed
                hold.with_suffix(f".go-{loads}").touch()
            time.sleep(0.01)
        hold.with_suffix(".go-all").touch()
        assert loads >= 2 and 1 not in group.live(), (loads, group.live())
        held.touch()  # the survivors wait before the next step's exchange
        stepping.start()
        _wait(lambda: 1 in group.live(), "the replacement never joined")
    finally:
        held.unlink(missing_ok=True)
        hold.with_suffix(".go-all").touch()
        stepping.join(timeout=120)
    step = group.committed_steps
    assert [(o.step, o.committed, o.participants) for o in outcomes] == [(step, True, (0, 1, 2))]
    assert recovery.in_flight, "it joined the step in flight, not the next one"
    train(group, step + 2)
    assert_invariants(group)


def test_the_update_log_keeps_the_memory_of_what_it_stops_keeping() -> None:
    """A group keeps updates only while a replacement is on its way: when it stops, the
    memory of those updates serves the next replacement's first steps (no fresh memory), but
    never memory a transport may still read (a lent update)."""
    log = UpdateLog()
    log.resize(2)
    updates = {step: torch.full((4,), float(step)) for step in range(1, 8)}
    for step in (1, 2, 3):
        log.record(step, updates[step])
    lent = log.lend(3, 3)  # the transport still holds update 3
    log.resize(0)  # the replacement joined
    assert log.record(4, updates[4]) is updates[4]  # nothing kept: its own memory back
    log.resize(2)  # the next replacement is on its way
    handed = [log.record(step, updates[step]) for step in (5, 6)]
    assert [h is updates[2] for h in handed] == [True, False] and handed[1] is None
    assert lent is not None
