"""Restart policies on a fake clock: intensity windows, backoff bounds, strategies, types."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervision import RestartPolicy, RestartTracker

policies = st.builds(
    RestartPolicy,
    strategy=st.sampled_from(["one_for_one", "one_for_all", "rest_for_one"]),
    max_restarts=st.integers(0, 5),
    within_s=st.floats(0.1, 10.0),
    backoff_s=st.floats(0.0, 1.0),
    backoff_max_s=st.just(5.0),
    jitter=st.floats(0.0, 1.0),
)
gaps = st.lists(st.floats(0.0, 3.0), min_size=1, max_size=40)


def reference_decisions(policy: RestartPolicy, times: list[float]) -> list[bool]:
    """Plain model: a failure at t restarts iff fewer than max_restarts restarts were granted
    in the window (t - within_s, t]... counting only granted ones, as OTP does."""
    granted: list[float] = []
    out = []
    for t in times:
        recent = [g for g in granted if t - g <= policy.within_s]
        ok = len(recent) < policy.max_restarts
        if ok:
            granted.append(t)
        out.append(ok)
    return out


@given(policy=policies, steps=gaps, seed=st.integers(0, 2**32))
@settings(max_examples=300, deadline=None)
def test_restarts_follow_the_intensity_window(
    policy: RestartPolicy, steps: list[float], seed: int
) -> None:
    now = [0.0]
    tracker = RestartTracker(policy, size=4, clock=lambda: now[0], rng=random.Random(seed))
    times = []
    for gap in steps:
        now[0] += gap
        times.append(now[0])
    decisions = []
    for t in times:
        now[0] = t
        decisions.append(not tracker.on_failure(rank=1).escalate)
    assert decisions == reference_decisions(policy, times)
    granted = [t for t, ok in zip(times, decisions) if ok]
    for t in granted:  # never more than max_restarts in any window
        assert sum(1 for g in granted if 0 <= t - g <= policy.within_s) <= policy.max_restarts


@given(policy=policies, attempt=st.integers(1, 20), seed=st.integers(0, 2**32))
def test_backoff_is_exponential_capped_and_jittered_within_bounds(
    policy: RestartPolicy, attempt: int, seed: int
) -> None:
    delay = policy.backoff(attempt, random.Random(seed))
    base = min(policy.backoff_max_s, policy.backoff_s * 2 ** (attempt - 1))
    assert base * (1 - policy.jitter) - 1e-9 <= delay <= base * (1 + policy.jitter) + 1e-9


def test_backoff_grows_within_a_burst_and_resets_after_a_quiet_window() -> None:
    policy = RestartPolicy(max_restarts=10, within_s=1.0, backoff_s=0.1, jitter=0.0)
    now = [0.0]
    tracker = RestartTracker(policy, size=1, clock=lambda: now[0])
    delays = []
    for _ in range(4):
        delays.append(tracker.on_failure(0).delay_s)
        now[0] += 0.1
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8])
    now[0] += 5.0
    assert tracker.on_failure(0).delay_s == pytest.approx(0.1)


@given(
    strategy=st.sampled_from(["one_for_one", "one_for_all", "rest_for_one"]),
    size=st.integers(1, 16),
    data=st.data(),
)
def test_strategies_pick_the_documented_ranks(
    strategy: str, size: int, data: st.DataObject
) -> None:
    failed = data.draw(st.integers(0, size - 1))
    ranks = RestartPolicy(strategy=strategy).ranks_to_restart(failed, size)  # type: ignore[arg-type]
    expected = {
        "one_for_one": (failed,),
        "one_for_all": tuple(range(size)),
        "rest_for_one": tuple(range(failed, size)),
    }[strategy]
    assert ranks == expected


def test_restart_types() -> None:
    assert RestartTracker(RestartPolicy(restart="temporary"), 2).on_failure(0).escalate
    transient = RestartTracker(RestartPolicy(restart="transient"), 2)
    assert transient.on_failure(0, clean_exit=True).escalate
    assert not transient.on_failure(0, clean_exit=False).escalate
    assert not RestartTracker(RestartPolicy(), 2).on_failure(0, clean_exit=True).escalate


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"strategy": "one_for_some"}, "unknown restart strategy"),
        ({"restart": "sometimes"}, "unknown restart type"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"backoff_s": 2.0, "backoff_max_s": 1.0}, "backoff_s <= backoff_max_s"),
    ],
)
def test_bad_policies_are_refused_with_a_clear_message(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        RestartPolicy(**kwargs)
