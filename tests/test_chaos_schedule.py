"""Fault schedules (`RandomSchedule`, `ScriptedSchedule`), checked without any processes.

Random plans are checked for determinism, seed sensitivity, their bounds, the concurrency and
per-target limits, the kinds and targets they use, and the arrival rate; ``from_mix`` and the
validation for their error messages; ``replay_args`` by parsing it back.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos import (
    FAULT_KINDS,
    FAULT_SPECS,
    Fault,
    PlannedFault,
    RandomSchedule,
    Schedule,
    ScriptedSchedule,
    Target,
    TargetSet,
)

pytestmark = pytest.mark.timeout(60)

SETTINGS = settings(max_examples=150, deadline=None, database=None)

# -- strategies ---------------------------------------------------------------------------------

target_sets = st.builds(
    TargetSet,
    meshes=st.dictionaries(
        st.sampled_from(["trainer", "a", "b"]), st.integers(0, 5), max_size=3
    ).map(lambda d: tuple(d.items())),
    hosts=st.integers(0, 3),
    client=st.booleans(),
    job=st.booleans(),
)
weights = st.one_of(
    st.integers(1, 5).map(float), st.floats(0.05, 5.0, allow_nan=False, allow_infinity=False)
)
mixes = st.lists(
    st.tuples(st.sampled_from(FAULT_KINDS), weights),
    min_size=1,
    max_size=len(FAULT_KINDS),
    unique_by=lambda kw: kw[0],
).map(tuple)
seeds = st.integers(0, 2**64)


@st.composite
def schedules(draw: st.DrawFn, /, **fixed: Any) -> RandomSchedule:
    """Random schedules of up to a few hundred faults; keywords in `fixed` are kept."""
    params: dict[str, Any] = {
        "seed": draw(seeds),
        "mtbf_s": draw(st.floats(0.05, 5.0)),
        "warmup_s": draw(st.floats(0.0, 2.0)),
        "faults": draw(mixes),
        "max_concurrent": draw(st.integers(1, 4)),
        "settle_s": draw(st.floats(0.0, 3.0)),
    }
    params["duration_s"] = params["warmup_s"] + draw(st.floats(0.5, 60.0))
    params.update(fixed)
    return RandomSchedule(**params)


# -- helpers ------------------------------------------------------------------------------------


def key(plan: list[PlannedFault]) -> list[tuple[float, Fault, Target]]:
    """A plan as comparable values (PlannedFault's own == compares only at_s)."""
    return [(p.at_s, p.fault, p.target) for p in plan]


def windows(schedule: RandomSchedule, plan: list[PlannedFault]) -> list[tuple[float, float]]:
    return [(p.at_s, p.at_s + p.fault.duration_s + schedule.settle_s) for p in plan]


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most half-open intervals [start, end) that contain one moment."""
    events = []
    for start, end in intervals:
        if end > start:
            events.append((start, 1))
            events.append((end, -1))
    events.sort()  # at equal times the -1 (a window closing) comes first
    most = current = 0
    for _, delta in events:
        current += delta
        most = max(most, current)
    return most


def same_target_overlaps(schedule: RandomSchedule, plan: list[PlannedFault]) -> list[str]:
    """Pairs of faults on one target whose windows overlap (an empty window overlaps nothing,
    but a fault starting inside another's window on its target counts)."""
    by_target: dict[Target, list[tuple[float, float]]] = {}
    for p, w in zip(plan, windows(schedule, plan)):
        by_target.setdefault(p.target, []).append(w)
    bad = []
    for target, ws in by_target.items():
        ws.sort()
        for (s1, e1), (s2, e2) in itertools.pairwise(ws):
            if s2 < e1:
                bad.append(f"{target}: [{s1}, {e1}) and [{s2}, {e2})")
    return bad


def test_checkers_detect_violations() -> None:
    assert max_overlap([(0, 2), (1, 3), (1.5, 1.6)]) == 3
    assert max_overlap([(0, 2), (2, 4), (4, 4)]) == 1
    s = RandomSchedule(seed=0, mtbf_s=1, duration_s=10, settle_s=1.0)
    t = Target.of_rank("a", 0)
    assert same_target_overlaps(s, [PlannedFault(1.0, Fault.kill(), t)] * 2)
    assert not same_target_overlaps(
        s, [PlannedFault(1.0, Fault.kill(), t), PlannedFault(2.0, Fault.kill(), t)]
    )


# -- determinism --------------------------------------------------------------------------------


@SETTINGS
@given(schedules(), target_sets)
def test_same_seed_and_targets_give_the_same_plan(schedule: RandomSchedule, ts: TargetSet) -> None:
    random.seed(1)
    first = schedule.plan(ts)
    random.seed(2)
    again = schedule.plan(ts)
    rebuilt = RandomSchedule(
        **{f.name: getattr(schedule, f.name) for f in dataclasses.fields(schedule)}
    )
    same_targets = TargetSet(tuple(reversed(ts.meshes)), ts.hosts, ts.client, ts.job)
    assert key(first) == key(again)
    assert key(first) == key(rebuilt.plan(same_targets))
    assert json.dumps([p.to_dict() for p in first]) == json.dumps([p.to_dict() for p in again])


@SETTINGS
@given(st.integers(0, 2**32), mixes)
def test_distinct_seeds_give_distinct_plans(base: int, mix: tuple[tuple[str, float], ...]) -> None:
    ts = TargetSet(meshes=(("w", 4),), hosts=2, job=True)
    plans = []
    for seed in range(base, base + 20):
        plan = RandomSchedule(seed=seed, mtbf_s=1.0, duration_s=60.0, faults=mix).plan(ts)
        assert len(plan) >= 5, f"seed {seed} planned only {len(plan)} faults"
        plans.append(json.dumps([p.to_dict() for p in plan]))
    assert len(set(plans)) >= 19


def test_many_fixed_seeds_all_give_distinct_plans() -> None:
    ts = TargetSet(meshes=(("w", 8),), hosts=2)
    mix = RandomSchedule.from_mix(0, 1, 2, "kill,pause,partition").faults
    plans = {
        json.dumps([p.to_dict() for p in RandomSchedule(seed, 1.0, 40.0, faults=mix).plan(ts)])
        for seed in range(200)
    }
    assert len(plans) == 200


# -- the rules a plan follows -------------------------------------------------------------------


def check_plan(schedule: RandomSchedule, ts: TargetSet, plan: list[PlannedFault]) -> None:
    usable = {k for k, _ in schedule.faults if ts.candidates(FAULT_SPECS[k].level)}
    assert [p.at_s for p in plan] == sorted(p.at_s for p in plan)
    for p in plan:
        assert schedule.warmup_s <= p.at_s < schedule.duration_s
        assert p.at_s == round(p.at_s, 3)
        assert p.fault.kind in usable
        assert p.target in ts
        assert p.target.level == FAULT_SPECS[p.fault.kind].level
        f = p.fault
        if f.kind == "kill":
            assert (f.signal in schedule.kill_signals and f.exit_code is None) or (
                f.signal is None and f.exit_code in schedule.exit_codes
            )
        elif f.kind == "pause":
            assert schedule.pause_s[0] <= f.duration_s <= schedule.pause_s[1]
        elif f.kind == "raise":
            assert f.endpoint == schedule.raise_endpoint
        elif f.kind in ("drop", "delay", "partition"):
            assert schedule.window_s[0] <= f.duration_s <= schedule.window_s[1]
            if f.kind == "drop":
                assert f.probability == schedule.drop_probability
            if f.kind == "delay":
                assert schedule.delay_ms[0] <= f.delay_ms <= schedule.delay_ms[1]
        else:
            assert f.duration_s == 0
    assert max_overlap(windows(schedule, plan)) <= schedule.max_concurrent
    assert same_target_overlaps(schedule, plan) == []


@SETTINGS
@given(schedules(), target_sets)
def test_plans_follow_the_rules(schedule: RandomSchedule, ts: TargetSet) -> None:
    plan = schedule.plan(ts)
    check_plan(schedule, ts, plan)
    # The first arrival always finds a free target; it comes after 40 mtbf with p = e^-40.
    usable = any(ts.candidates(FAULT_SPECS[k].level) for k, _ in schedule.faults)
    if usable and schedule.duration_s - schedule.warmup_s > 40 * schedule.mtbf_s:
        assert plan


@pytest.mark.parametrize("max_concurrent", [1, 2, 3])
def test_the_concurrency_limit_is_reached_but_not_exceeded(max_concurrent: int) -> None:
    ts = TargetSet(meshes=(("w", 8),), hosts=0, client=False)
    s = RandomSchedule(
        seed=3,
        mtbf_s=0.05,
        duration_s=60.0,
        faults=(("pause", 1.0),),
        max_concurrent=max_concurrent,
    )
    plan = s.plan(ts)
    check_plan(s, ts, plan)
    assert max_overlap(windows(s, plan)) == max_concurrent
    # Faults arrive far faster than windows close, so nearly all wait for one to close.
    assert len(plan) <= (60.0 / 2.5 + 1) * max_concurrent


def test_busy_targets_are_skipped() -> None:
    # One target and up to 3 concurrent faults: they must still go one after the other.
    ts = TargetSet(meshes=(("w", 1),), hosts=0, client=False)
    s = RandomSchedule(
        seed=5, mtbf_s=0.1, duration_s=60.0, faults=(("pause", 1.0),), max_concurrent=3
    )
    plan = s.plan(ts)
    assert len(plan) > 5
    assert max_overlap(windows(s, plan)) == 1
    assert same_target_overlaps(s, plan) == []


def test_kinds_without_candidates_are_left_out() -> None:
    mix = "kill,pause,partition,kill_client"
    no_ranks = TargetSet(meshes=(), hosts=2, client=False)
    plan = RandomSchedule.from_mix(1, 0.5, 60.0, mix, max_concurrent=2).plan(no_ranks)
    assert plan
    assert {p.fault.kind for p in plan} == {"partition"}
    empty_meshes = TargetSet(meshes=(("w", 0),), hosts=0, client=True)
    plan = RandomSchedule.from_mix(1, 0.5, 60.0, mix).plan(empty_meshes)
    assert plan
    assert {p.fault.kind for p in plan} == {"kill_client"}
    nothing = TargetSet(meshes=(("w", 0),), hosts=0, client=False)
    assert RandomSchedule.from_mix(1, 0.5, 60.0, mix).plan(nothing) == []


def test_every_kind_of_the_mix_appears_and_weights_count() -> None:
    ts = TargetSet(meshes=(("w", 16),), hosts=4, job=True)
    s = RandomSchedule.from_mix(
        11,
        0.5,
        2000.0,
        "kill:8,pause:1,raise:1,drop:1,delay:1,partition:1,kill_agent:1,kill_client:1,"
        "kill_node:1,preempt:1",
        max_concurrent=64,
        settle_s=0.0,
        raise_endpoint="step",
    )
    plan = s.plan(ts)
    check_plan(s, ts, plan)
    kinds = Counter(p.fault.kind for p in plan)
    assert set(kinds) == set(FAULT_KINDS)
    assert 0.35 < kinds["kill"] / len(plan) < 0.65  # weight 8 of 17
    exits = sum(1 for p in plan if p.fault.kind == "kill" and p.fault.exit_code is not None)
    assert 0.1 < exits / kinds["kill"] < 0.3  # EXIT_PROBABILITY = 0.2


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mtbf_s", [0.5, 2.0])
def test_mean_interarrival_follows_mtbf(seed: int, mtbf_s: float) -> None:
    # Kills with no settle time occupy nothing, so no fault is moved or skipped.
    ts = TargetSet(meshes=(("w", 4),), hosts=1)
    s = RandomSchedule(seed=seed, mtbf_s=mtbf_s, duration_s=1.0 + 1000 * mtbf_s, settle_s=0.0)
    plan = s.plan(ts)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(plan)]
    assert 900 < len(plan) < 1100
    assert 0.9 * mtbf_s < sum(gaps) / len(gaps) < 1.1 * mtbf_s


@pytest.mark.parametrize("seed", range(5))
def test_a_fault_that_waits_restarts_the_arrivals(seed: int) -> None:
    # One at a time, kills occupy 2 s (settle_s). An arrival inside a window waits for it to
    # close and the next arrival is drawn from there, so every gap is max(2, Exp(mtbf)):
    # mean 2 + e^-2 ~ 2.135 s for mtbf 1 s (arrivals that kept their own clock would queue
    # up behind the windows, giving gaps of exactly 2 s).
    ts = TargetSet(meshes=(("w", 4),), hosts=1)
    s = RandomSchedule(seed=seed, mtbf_s=1.0, duration_s=2001.0, settle_s=2.0)
    plan = s.plan(ts)
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(plan)]
    assert min(gaps) > 2.0 - 1e-9
    assert 2.07 < sum(gaps) / len(gaps) < 2.2


@pytest.mark.parametrize("seed", range(20))
def test_times_are_rounded_up_into_the_bounds(seed: int) -> None:
    # Arrivals within half a millisecond after a warmup that is not a whole millisecond: a
    # plain round(x, 3) would put them before the warmup.
    ts = TargetSet(meshes=(("w", 64),), hosts=0)
    s = RandomSchedule(
        seed=seed, mtbf_s=0.00005, warmup_s=1.0004, duration_s=1.003, settle_s=0.0,
        max_concurrent=64,
    )  # fmt: skip
    plan = s.plan(ts)
    assert len(plan) > 10
    assert plan[0].at_s == 1.001
    check_plan(s, ts, plan)


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_each_fault_spec_draws_faults_of_its_own_kind(kind: str) -> None:
    """The spec table is the one place a kind is defined: its draw gives a fault of that kind,
    whose spec is the same entry and whose description is not empty."""
    spec = FAULT_SPECS[kind]
    schedule = RandomSchedule(seed=1, mtbf_s=1.0, duration_s=5.0, faults=((kind, 1.0),))
    rng = random.Random(1)
    for _ in range(20):
        fault = spec.draw(schedule, rng)
        assert fault.kind == kind
        assert fault.spec is spec
        assert fault.describe()


# -- from_mix and validation --------------------------------------------------------------------


def test_from_mix_parses_kinds_and_weights() -> None:
    s = RandomSchedule.from_mix(7, 2.0, 30.0, "kill,pause,drop")
    assert s.faults == (("kill", 1.0), ("pause", 1.0), ("drop", 1.0))
    s = RandomSchedule.from_mix(7, 2.0, 30.0, " kill:3 , pause:0.5", max_concurrent=2)
    assert s.faults == (("kill", 3.0), ("pause", 0.5))
    assert s.max_concurrent == 2
    assert (s.seed, s.mtbf_s, s.duration_s) == (7, 2.0, 30.0)


@pytest.mark.parametrize(
    ("mix", "message"),
    [
        ("kill,explode", r"unknown fault kind 'explode'.*known: kill, pause, raise.*kill_client"),
        ("Kill", r"unknown fault kind 'Kill'"),
        ("kill:x", r"bad weight in 'kill:x'.*'x' is not a number"),
        ("pause:0", r"bad weight in 'pause:0'.*positive"),
        ("pause:-1", r"bad weight in 'pause:-1'"),
        ("pause:nan", r"bad weight in 'pause:nan'"),
        ("pause:inf", r"bad weight in 'pause:inf'"),
        ("", r"empty item"),
        ("kill,,pause", r"empty item"),
        ("kill,kill:2", r"'kill' appears twice"),
    ],
)
def test_from_mix_rejects_bad_mixes(mix: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RandomSchedule.from_mix(1, 1.0, 10.0, mix)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"mtbf_s": 0.0}, "mtbf_s must be a positive"),
        ({"mtbf_s": -1.0}, "mtbf_s must be a positive"),
        ({"duration_s": 1.0}, r"duration_s \(1.0\) must be greater than warmup_s \(1.0\)"),
        ({"warmup_s": -0.5}, "warmup_s cannot be negative"),
        ({"max_concurrent": 0}, "max_concurrent must be at least 1"),
        ({"settle_s": -1.0}, "settle_s cannot be negative"),
        ({"faults": ()}, "at least one kind"),
        ({"faults": (("boom", 1.0),)}, r"unknown fault kind 'boom'.*known: kill, pause"),
        ({"faults": (("kill", 0.0),)}, "weight of 'kill' must be a positive"),
        ({"faults": (("kill", 1.0), ("kill", 2.0))}, "appears twice"),
        ({"kill_signals": (), "exit_codes": ()}, "kill_signals or exit_codes"),
        ({"drop_probability": 1.5}, r"drop_probability must be within \[0, 1\]"),
        ({"pause_s": (3.0, 1.0)}, "pause_s must be a range"),
        ({"window_s": (-1.0, 1.0)}, "window_s must be a range"),
        ({"delay_ms": (1.0, float("inf"))}, "delay_ms must be a range"),
    ],
)
def test_bad_parameters_are_rejected(changes: dict[str, Any], message: str) -> None:
    params: dict[str, Any] = {"seed": 1, "mtbf_s": 1.0, "duration_s": 10.0, **changes}
    with pytest.raises(ValueError, match=message):
        RandomSchedule(**params)


# -- report and replay --------------------------------------------------------------------------


def test_to_dict_has_every_parameter_and_is_json() -> None:
    s = RandomSchedule.from_mix(7, 2.0, 30.0, "kill:1,pause:0.5", raise_endpoint="step")
    d = json.loads(json.dumps(s.to_dict()))
    assert d["type"] == "random"
    for f in dataclasses.fields(s):
        assert f.name in d
    assert d["seed"] == 7
    assert d["faults"] == [["kill", 1.0], ["pause", 0.5]]
    assert d["raise_endpoint"] == "step"
    assert d["kill_signals"] == ["SIGKILL", "SIGTERM", "SIGSEGV"]


def test_replay_args_example() -> None:
    s = RandomSchedule.from_mix(7, 2.0, 30, "kill,pause")
    assert s.replay_args() == [
        "--seed", "7", "--mtbf", "2.0", "--duration", "30", "--faults", "kill:1,pause:1",
        "--warmup", "1.0", "--max-concurrent", "1",
    ]  # fmt: skip


def parse_replay(args: list[str]) -> RandomSchedule:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--mtbf", type=float, required=True)
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--faults", required=True)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--max-concurrent", type=int, default=1)
    ns = parser.parse_args(args)
    return RandomSchedule.from_mix(
        ns.seed,
        ns.mtbf,
        ns.duration,
        ns.faults,
        warmup_s=ns.warmup,
        max_concurrent=ns.max_concurrent,
    )


@SETTINGS
@given(schedules(settle_s=2.0), target_sets)
def test_replay_args_rebuild_an_equal_schedule(schedule: RandomSchedule, ts: TargetSet) -> None:
    args = schedule.replay_args()
    assert all(isinstance(a, str) for a in args)
    rebuilt = parse_replay(args)
    assert rebuilt == schedule
    assert key(rebuilt.plan(ts)) == key(schedule.plan(ts))


# -- scripted schedules -------------------------------------------------------------------------

TS = TargetSet(meshes=(("w", 2),), hosts=2, client=True)


def test_scripted_schedule_plans_its_faults_by_time() -> None:
    faults = (
        PlannedFault(5.0, Fault.partition(1.0), Target.of_host(1)),
        PlannedFault(1.0, Fault.kill("SIGTERM"), Target.of_rank("w", 1)),
        PlannedFault(3.0, Fault.kill_client(), Target.client()),
    )
    s = ScriptedSchedule(faults)
    assert key(s.plan(TS)) == key([faults[1], faults[2], faults[0]])
    assert s.seed is None
    assert s.replay_args() == []
    d = json.loads(json.dumps(s.to_dict()))
    assert d["type"] == "scripted"
    assert [PlannedFault.from_dict(x) for x in d["faults"]] == list(faults)
    assert [PlannedFault.from_dict(x).target for x in d["faults"]] == [f.target for f in faults]
    schedule: Schedule = s
    assert isinstance(schedule, ScriptedSchedule)


@pytest.mark.parametrize(
    ("planned", "message"),
    [
        (
            PlannedFault(1.0, Fault.kill(), Target.of_rank("w", 2)),
            r"rank 2 of mesh 'w', which does not exist; the targets are: "
            r"ranks 0-1 of mesh 'w', hosts 0-1, the client",
        ),
        (
            PlannedFault(1.0, Fault.kill(), Target.of_rank("x", 0)),
            r"rank 0 of mesh 'x', which does not exist",
        ),
        (
            PlannedFault(1.0, Fault.kill_agent(), Target.of_host(5)),
            r"host 5, which does not exist",
        ),
        (
            PlannedFault(2.0, Fault.kill(), Target.of_host(0)),
            r"kill SIGKILL at 2 s is aimed at host 0, but a 'kill' fault must be aimed at a rank",
        ),
        (
            PlannedFault(2.0, Fault.partition(1.0), Target.of_rank("w", 0)),
            r"'partition' fault must be aimed at a host",
        ),
        (
            PlannedFault(2.0, Fault.kill_client(), Target.of_host(1)),
            r"'kill_client' fault must be aimed at a client",
        ),
    ],
)
def test_scripted_schedule_rejects_bad_targets(planned: PlannedFault, message: str) -> None:
    ok = PlannedFault(0.5, Fault.pause(1.0), Target.of_rank("w", 0))
    with pytest.raises(ValueError, match=message):
        ScriptedSchedule((ok, planned)).plan(TS)


def test_scripted_client_fault_needs_a_client() -> None:
    s = ScriptedSchedule((PlannedFault(1.0, Fault.kill_client(), Target.client()),))
    assert len(s.plan(TS)) == 1
    with pytest.raises(ValueError, match="the client, which does not exist"):
        s.plan(TargetSet(meshes=(("w", 2),), hosts=2, client=False))
