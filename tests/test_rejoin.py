"""A replacement heals while the survivors go on stepping, and joins a later step.

The donors of the test's heal send nothing while a file exists, so the heal lasts as long as
the test wants: the survivors must commit steps meanwhile (no wait for a spawn or a heal),
and once the heal goes through, the replacement catches up on the steps committed since and
takes part, with parameters equal to a single-process replay of the run.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import replica_actors as ra
from test_replicas import HB, assert_invariants, pid_of

from mesh import this_host
from recovery import ReplicaGroup

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
