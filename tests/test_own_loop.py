"""Bring your own training loop: examples/own_training_loop.py's loop under real `LoopGroup`s,
with a replica SIGKILLing itself in the middle of a step; real procs, gloo and supervision."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import cloudpickle
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh import this_host
from recovery import LoopGroup, Manager
from recovery.testing import flatten_gradients, use_average

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "own_training_loop.py"
HB = 1.0
STEPS = 5


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("own_training_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # the procs cannot import examples/
    return module


def _batches(shard: int, steps: range) -> list[tuple[int, int]]:
    """(step, batch id) that a shard reads at `steps` when it keeps the group's position."""
    return [(step, (step - 1) * 1000 + shard) for step in steps]


def test_loops_killed_mid_step_heal_and_keep_their_place(groups: list[Any]) -> None:
    ex = _example()

    def start(replicas: int, kill: Any = None, min_replicas: int = 0, **kw: Any) -> LoopGroup:
        group = LoopGroup(
            this_host(),
            ex.train,
            STEPS,
            kill,
            replicas=replicas,
            min_replicas=min_replicas or replicas,
            heartbeat_timeout_s=HB,
            **kw,
        )
        groups.append(group)
        return group

    # All three start at once (their procs start together); each runs when asked.
    clean, retried = start(2), start(2, (1, 3), group_timeout_s=60.0)
    onward = start(2, (1, 3, "SIGSTOP"), min_replicas=1, group_timeout_s=60.0)
    fault_free = clean.run(timeout_s=200)
    assert fault_free[0]["read"] == _batches(0, range(1, STEPS + 1))
    assert fault_free[0]["digest"] == fault_free[1]["digest"]

    # All replicas needed: the survivor retries the step with the healed replacement, and the
    # run ends as the fault-free one did, bit for bit, every batch read once.
    results = retried.run(timeout_s=200)
    assert ex.continuity(fault_free, results) == []
    assert results[1]["incarnation"] == 1 and results[1]["read"] == _batches(1, range(3, 6))
    discarded = [o for o in retried.outcomes if not o.committed]
    assert [o.step for o in discarded] == [3]
    assert discarded[0].seconds < 20.0  # the survivor did not wait for the 60 s group timeout
    assert retried.history == [(step, (0, 1)) for step in range(1, STEPS + 1)]
    [recovery] = retried.recoveries
    assert recovery.replica == 1 and recovery.first_commit_at is not None

    # One of two needed, and the other hangs mid-step: the survivor gives up on it once it is
    # found hung and goes on alone; the replacement heals (data position included) and reads
    # from the group's position on: no batch twice, none skipped.
    results = onward.run(timeout_s=200)
    discarded = [o for o in onward.outcomes if not o.committed]
    assert [o.step for o in discarded] == [3] and discarded[0].seconds < 20.0
    assert {event.kind for event in onward.events} == {"hung"}
    assert len({result["digest"] for result in results.values()}) == 1
    assert results[0]["read"] == _batches(0, range(1, STEPS + 1))
    late = results[1]["read"]
    assert results[1]["incarnation"] == 1
    assert late == _batches(1, range(late[0][0], STEPS + 1) if late else range(0))
    assert all(members == (0,) for step, members in onward.history if step == 3)
    assert [step for step, _ in onward.history] == list(range(1, STEPS + 1))


def test_a_manager_outside_a_loop_group_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"started by recovery\.LoopGroup"):
        Manager(None, None)  # type: ignore[arg-type]  # refused before they are looked at


def test_bad_loop_group_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="min_replicas must be between 1 and replicas"):
        LoopGroup(this_host(), print, replicas=2, min_replicas=3)
    with pytest.raises(TypeError, match="runs a function in each replica"):
        LoopGroup(this_host(), "train")  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 7), st.booleans()), min_size=1, max_size=6),
    st.booleans(),
)
def test_a_manager_exchanges_one_flat_gradient_and_hands_back_views(
    params_spec: list[tuple[int, bool]], zeroed_in_place: bool
) -> None:
    """The own-loop Manager's arithmetic: the flat gradient is the concatenation of the
    parameters' gradients (zeros where one has none), in the same memory every step; the
    averaged gradients the optimizer then reads are views of the exchange's result."""
    torch.manual_seed(len(params_spec))
    params = [torch.nn.Parameter(torch.randn(size)) for size, _ in params_spec]
    flat = None
    for _ in range(2):  # the second step reuses the flat tensor of the first
        for param, (_, has_grad) in zip(params, params_spec):
            param.grad = torch.randn_like(param) if has_grad else None
        expected = torch.cat(
            [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        )
        memory = None if flat is None else flat.data_ptr()
        flat = flatten_gradients(params, flat)
        assert torch.equal(flat, expected)
        assert memory is None or flat.data_ptr() == memory
        averaged = flat * 0.5
        use_average(params, averaged)
        for param, part in zip(params, averaged.split([p.numel() for p in params])):
            assert param.grad is not None and torch.equal(param.grad, part)
            assert param.grad.data_ptr() == part.data_ptr()
        if zeroed_in_place:  # optimizer.zero_grad(set_to_none=False) zeroes the views
            for param in params:
                assert param.grad is not None
                param.grad.zero_()
