"""TorchFT-style replica recovery (`mesh.ReplicaGroup`) with real procs, gloo and kills.

Kills land at chosen points of a step (during the forward pass, during the gradient
exchange, while applying, while committing, between steps). Whatever happens, the invariants
of the design hold: every committed step was applied once by every participant, the
participants hold bitwise-identical parameters, the step counter moves by one, and the final
parameters equal a single-process replay of the committed steps with their participant sets.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import replica_actors as ra

from mesh import this_host
from mesh.testing import probe
from recovery import Recovery, ReplicaGroup, ReplicaGroupError, replay_training
from recovery import parameter_digest as digest

pytestmark = pytest.mark.timeout(240)

HB = 1.0  # heartbeat timeout of the replicas' procs


def pid_of(group: ReplicaGroup, replica: int) -> int:
    return int(next(iter(probe(group.replicas[replica]).get(timeout=30).values())))


def assert_invariants(group: ReplicaGroup, ranks_per_replica: int = 1) -> None:
    steps = [step for step, _ in group.history]
    assert steps == list(range(1, len(steps) + 1)), "the step counter moves by one"
    assert group.check_consistency() is None
    replayed = replay_training(ra.Trainer, group.history, ranks_per_replica)
    live = {d for entries in group.status().values() for _, d in entries}
    assert live == {digest(replayed)}, "the replicas equal a single-process replay"


def train(
    group: ReplicaGroup,
    steps: int,
    between: dict[int, int] | None = None,
    full_before: set[int] = frozenset(),  # type: ignore[assignment]
) -> None:
    """Step until `steps` are committed; `between` = {after committed step: replica to
    SIGKILL from outside before the next step}; before the steps in `full_before`, wait for
    every replica to be back."""
    between = dict(between or {})
    tried: set[int] = set()
    attempts = 0
    while group.committed_steps < steps:
        if group.committed_steps + 1 in full_before - tried:  # not again when retrying it
            group.wait_for_all()
        tried.add(group.committed_steps + 1)
        victim = between.pop(group.committed_steps, None)
        if victim is not None:
            os.kill(pid_of(group, victim), signal.SIGKILL)
        group.step()
        attempts += 1
        assert attempts < steps * 3, f"too many discarded steps: {group.outcomes[-5:]}"


def train_until_recovered(group: ReplicaGroup, timeout: float = 60.0) -> None:
    """Go on stepping until the latest replacement of every replica has committed a step
    (an earlier one may have died before it could)."""
    deadline = time.monotonic() + timeout
    while any(r.first_commit_at is None for r in latest_recoveries(group)):
        assert time.monotonic() < deadline, group.recoveries
        group.step()


def latest_recoveries(group: ReplicaGroup) -> list[Recovery]:
    latest = {r.replica: r for r in group.recoveries}
    return list(latest.values())


def test_kills_at_every_point_of_a_step_keep_the_invariants(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    plan = {1: [(4, "forward"), (16, "commit")], 2: [(8, "allreduce")], 0: [(12, "apply")]}
    group = ReplicaGroup(
        this_host(), ra.DyingTrainer, plan, str(tmp_path), replicas=3, heartbeat_timeout_s=HB
    )
    groups.append(group)
    train(group, 24, between={19: 1}, full_before={4, 8, 12, 16, 20})
    train_until_recovered(group)
    assert_invariants(group)
    assert len(group.recoveries) == 5
    assert all(r.first_commit_at is not None for r in latest_recoveries(group))
    assert group.live() == (0, 1, 2)
    discarded = [o.step for o in group.outcomes if not o.committed]
    # Survivors lose at most the one step in flight per kill, and the kills while committing
    # and while applying the update cost none: those steps were decided.
    assert len(discarded) == len(set(discarded)), discarded
    assert set(discarded) <= {4, 8, 20}, discarded
    by_step = dict(group.history)
    # (the replacements of 1, killed in step 4, and 2, in step 8, may join the retry of that
    # step in flight, or a later one: `InFlight.join`; the replay above holds either way)
    assert by_step[12] == by_step[16] == (0, 1, 2)  # a replica died committing each


def test_a_kill_mid_exchange_costs_the_survivors_no_second_forward_pass(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """The survivors keep their gradient of the step that a death discarded: its retry
    without the dead replica only exchanges them, and the bits still equal the replay."""
    plan = {2: [(5, "allreduce")]}
    group = ReplicaGroup(
        this_host(), ra.CountsForwards, plan, str(tmp_path), replicas=3, heartbeat_timeout_s=HB
    )
    groups.append(group)
    train(group, 8)
    train_until_recovered(group)
    assert_invariants(group)
    assert {o.step for o in group.outcomes if not o.committed} == {5}, group.outcomes
    # the survivors retry it; the dead replica's replacement may be in the retry too, if it was
    # healed and caught up by the retry's start (or joined it in flight: `InFlight.join`)
    assert dict(group.history)[5] in {(0, 1), (0, 1, 2)}, group.history
    for survivor in (0, 1):
        forwards = (tmp_path / f"forwards-{survivor}").read_text().split()
        assert forwards.count("5") == 1, forwards


def test_below_min_replicas_the_group_waits_for_a_replacement(
    groups: list[ReplicaGroup],
) -> None:
    group = ReplicaGroup(
        this_host(), ra.Trainer, replicas=3, min_replicas=3, heartbeat_timeout_s=HB
    )
    groups.append(group)
    train(group, 3, between={2: 2})
    train_until_recovered(group)
    assert all(len(members) == 3 for _, members in group.history), group.history
    assert all(r.first_commit_at is not None for r in latest_recoveries(group))
    assert_invariants(group)


def test_the_wait_for_replacements_is_bounded(groups: list[ReplicaGroup], tmp_path: Path) -> None:
    gate = tmp_path / "let-the-replacement-build"
    group = ReplicaGroup(
        this_host(),
        ra.GatedReplacement,
        str(tmp_path),
        str(gate),
        2,
        replicas=2,
        min_replicas=2,
        wait_for_replicas_s=0.05,
    )
    groups.append(group)
    group.step()
    os.kill(pid_of(group, 1), signal.SIGKILL)
    with pytest.raises(ReplicaGroupError, match="2 are needed"):
        for _ in range(3):  # the death may be noticed by the step itself, or before it
            group.step()
    gate.touch()
    group.wait_for_replicas_s = 60.0  # the replacement still comes, and training goes on
    train(group, 3)
    assert_invariants(group)


def test_a_replica_failing_while_the_group_starts_is_replaced(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    group = ReplicaGroup(this_host(), ra.DiesWhileBuilt, str(tmp_path), replicas=3)
    groups.append(group)
    assert len(group.recoveries) == 1, group.recoveries
    assert "SIGKILL" in group.recoveries[0].event
    train(group, 3)
    train_until_recovered(group)
    assert group.live() == (0, 1, 2)
    assert_invariants(group)


def test_a_hung_replica_is_replaced(groups: list[ReplicaGroup]) -> None:
    group = ReplicaGroup(this_host(), ra.Trainer, replicas=3, heartbeat_timeout_s=HB)
    groups.append(group)
    train(group, 2)
    os.kill(pid_of(group, 0), signal.SIGSTOP)
    train(group, 8)
    assert [r.replica for r in group.recoveries] == [0]
    assert "hung" in group.recoveries[0].event or "heartbeat" in group.recoveries[0].event
    assert_invariants(group)


def test_replicas_keep_big_tensors_in_one_heap(groups: list[ReplicaGroup]) -> None:
    """A replica's procs get `TENSOR_MALLOC` (GLIBC_TUNABLES, applied as the proc starts):
    64 MiB buffers allocated and freed again and again reuse their memory, where glibc's
    defaults map each afresh (16,384 page faults a buffer)."""
    group = ReplicaGroup(this_host(), ra.AllocatingTrainer, replicas=2)
    groups.append(group)
    faults = group.replicas[0].faults_of_allocations.call_one(64, 5).get(timeout=60)
    assert faults < 5 * 16384 // 20, f"{faults} page faults: the heap was not kept"


def test_replicas_of_several_ranks(groups: list[ReplicaGroup]) -> None:
    group = ReplicaGroup(
        this_host(), ra.Trainer, replicas=2, per_replica={"gpus": 2}, heartbeat_timeout_s=HB
    )
    groups.append(group)
    assert group.ranks_per_replica == 2
    train(group, 3, between={1: 1})
    assert_invariants(group, ranks_per_replica=2)


def test_a_late_prepare_of_a_surviving_rank_leaves_no_trace(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    """Rank 0 of replica 1 dies in step 2; its rank 1 lives on and begins its prepare of step 2
    only after its replica's heal began (`LateSurvivingRank`). That late attempt at the
    discarded step must not leave a gradient that the retry of step 2 exchanges."""
    plan = {1: [(2, "forward")]}
    group = ReplicaGroup(
        this_host(), ra.LateSurvivingRank, plan, str(tmp_path), replicas=2,
        per_replica={"gpus": 2}, heartbeat_timeout_s=HB,
    )  # fmt: skip
    groups.append(group)
    train(group, 3)
    assert (tmp_path / "late-prepare-ended").exists(), "the late prepare did not run"
    assert [o.step for o in group.outcomes if not o.committed] == [2], group.outcomes
    assert_invariants(group, ranks_per_replica=2)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        ReplicaGroup(this_host(), ra.Trainer, replicas=2, min_replicas=3)
    with pytest.raises(TypeError, match="Replica subclass"):
        ReplicaGroup(this_host(), object, replicas=2)  # type: ignore[arg-type]


NUMPY_BLOCKER = """\
import importlib.machinery
import sys
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch warns once


class _PathFinderWithoutNumpy(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] == "numpy":
            return None  # as if it were not installed
        return super().find_spec(name, path, target)


sys.meta_path[:] = [
    _PathFinderWithoutNumpy if f is importlib.machinery.PathFinder else f for f in sys.meta_path
]
"""


def test_torch_alone_is_enough(tmp_path: Path) -> None:
    """Without numpy (hidden from a client and all its processes by a sitecustomize), a
    group trains, heals a killed replica and checks its parameter digests."""
    (tmp_path / "sitecustomize.py").write_text(NUMPY_BLOCKER)
    repo = str(Path(__file__).parent.parent)  # whichever checkout the package is installed from
    path = os.pathsep.join(p for p in [str(tmp_path), repo, os.environ.get("PYTHONPATH")] if p)
    script = Path(__file__).parent / "scripts" / "replicas_without_numpy.py"
    done = subprocess.run(
        [sys.executable, str(script)],
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout, done.stderr[-4000:])
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["numpy_here"] is False and result["numpy_in_proc"] is False, result
    assert result["consistency"] is None and result["healed"] >= 1, result
    assert result["digests"] == [result["replayed"]], result
