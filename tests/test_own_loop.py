"""Bring your own training loop: examples/own_training_loop.py under a real `LoopGroup`, with
a replica SIGKILLed in the middle of a step; real procs, gloo and supervision."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import cloudpickle
import pytest

pytestmark = pytest.mark.timeout(240)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_training_loop.py"
HB = 1.0


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("own_training_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # the procs cannot import examples/
    return module


def test_a_loop_killed_mid_step_heals_and_ends_as_a_fault_free_run() -> None:
    ex = _example()
    clean, _ = ex.run_group(2, 5, heartbeat_timeout_s=HB)
    faulty, group = ex.run_group(2, 5, (1, 3), heartbeat_timeout_s=HB, group_timeout_s=60.0)
    print(group.outcomes, group.recoveries)
    assert ex.continuity(clean, faulty) == []
    assert faulty[1]["incarnation"] == 1 and faulty[1]["read"][0][0] == 3
    discarded = [o for o in group.outcomes if not o.committed]
    assert [o.step for o in discarded] == [3]
    assert discarded[0].seconds < 20.0  # not the group's 60 s timeout
    assert group.history == [(step, (0, 1)) for step in range(1, 6)]
