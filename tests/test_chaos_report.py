"""The chaos run report: its JSON schema round trip, the validator, percentiles, rendering.

Pure data, no processes: reports are built from random fault records, events and invariants.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console

from chaos import (
    FAULT_KINDS,
    REPORT_SCHEMA,
    VERDICTS,
    Fault,
    FaultRecord,
    InvariantResult,
    ObservedEvent,
    PlannedFault,
    RunReport,
    Target,
    percentiles,
    render,
    render_text,
    validate_report,
)

pytestmark = pytest.mark.timeout(60)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- strategies ------------------------------------------------------------------------------

times = st.floats(min_value=0.0, max_value=3600.0, allow_nan=False, allow_infinity=False)
durations = st.floats(min_value=0.0, max_value=60.0, allow_nan=False, allow_infinity=False)
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
texts = st.text(max_size=40)
event_kinds = st.sampled_from(["exit", "crash", "unresponsive", "escalated", "agent_lost"])

targets = st.one_of(
    st.builds(Target.of_rank, names, st.integers(0, 63)),
    st.builds(Target.of_host, st.integers(0, 7)),
    st.just(Target.client()),
)

faults = st.one_of(
    st.builds(Fault.kill, st.sampled_from(["SIGKILL", "SIGSEGV", "SIGTERM"])),
    st.builds(Fault.exit, st.integers(-255, 255)),
    st.builds(Fault.pause, durations),
    st.builds(Fault.raise_in, st.none() | names, fatal=st.booleans()),
    st.builds(Fault.drop, st.floats(0.0, 1.0), durations),
    st.builds(Fault.delay, st.floats(0.0, 5000.0), durations),
    st.builds(Fault.partition, durations),
    st.just(Fault.kill_agent()),
    st.just(Fault.kill_client()),
)


@st.composite
def fault_records(draw: st.DrawFn, index: int) -> FaultRecord:
    at = draw(times)
    injected = draw(st.none() | st.just(at + draw(st.floats(0.0, 0.5))))
    detected = draw(st.none() | st.just((injected or at) + draw(durations)))
    healthy = draw(st.none() | st.just((injected or at) + draw(durations)))
    return FaultRecord(
        index=index,
        planned=PlannedFault(at, draw(faults), draw(targets)),
        expected=tuple(draw(st.lists(event_kinds, max_size=3))),
        injected_at_s=injected,
        detected_at_s=detected,
        healthy_at_s=healthy,
        observed=draw(st.lists(event_kinds, max_size=3)),
        verdict=draw(st.sampled_from(VERDICTS)),
        note=draw(texts),
    )


@st.composite
def events(draw: st.DrawFn, n_faults: int) -> ObservedEvent:
    attributed = st.integers(0, n_faults - 1) if n_faults else st.nothing()
    return ObservedEvent(
        at_s=draw(times),
        kind=draw(event_kinds),
        mesh=draw(st.none() | names),
        rank=draw(st.none() | st.integers(0, 63)),
        host=draw(st.none() | st.integers(0, 7)),
        pid=draw(st.none() | st.integers(1, 2**22)),
        message=draw(texts),
        fault=draw(st.none() | attributed),
        evidence=draw(texts),
    )


invariants = st.builds(InvariantResult, names, st.booleans(), texts, st.booleans())
json_scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | times | texts
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
    max_leaves=8,
)
json_objects = st.dictionaries(names, json_values, max_size=4)


@st.composite
def reports(draw: st.DrawFn) -> RunReport:
    n = draw(st.integers(0, 8))
    records = [draw(fault_records(i)) for i in range(n)]
    return RunReport(
        seed=draw(st.none() | st.integers(0, 2**63 - 1)),
        replay=draw(texts),
        workload=draw(names),
        started_at=draw(
            st.sampled_from(["2024-05-01T10:00:00+00:00", "2025-01-31T23:59:59.123456Z"])
        ),
        wall_s=draw(times),
        schedule=draw(json_objects),
        targets=draw(json_objects),
        faults=records,
        events=draw(st.lists(events(n), max_size=8)),
        invariants=draw(st.lists(invariants, max_size=4)),
        workload_stats=draw(json_objects),
    )


def example_report() -> RunReport:
    """A small fixed report: two observed faults, one not injected, one unexpected event."""
    records = [
        FaultRecord(
            0,
            PlannedFault(1.0, Fault.kill("SIGSEGV"), Target.of_rank("trainer", 3)),
            ("exit",),
            injected_at_s=1.0,
            detected_at_s=1.04,
            healthy_at_s=2.5,
            observed=["exit"],
            verdict="ok",
        ),
        FaultRecord(
            1,
            PlannedFault(3.0, Fault.pause(1.5), Target.of_rank("trainer", 1)),
            ("unresponsive",),
            injected_at_s=3.0,
            observed=[],
            verdict="missed",
        ),
        FaultRecord(
            2,
            PlannedFault(5.0, Fault.partition(2.0), Target.of_host(1)),
            ("agent_lost",),
            verdict="not_injected",
            note="host 1 is gone",
        ),
    ]
    events = [
        ObservedEvent(1.04, "exit", "trainer", 3, 0, 4242, "rank 3 died of SIGSEGV", fault=0),
        ObservedEvent(4.2, "crash", "trainer", 0, 0, 4240, "ZeroDivisionError [boom]"),
    ]
    return RunReport(
        seed=1234567,
        replay="meshvisor chaos --seed 1234567 examples/train.py",
        workload="examples/train.py",
        started_at="2024-05-01T10:00:00+00:00",
        wall_s=12.5,
        schedule={"faults": ["kill", "pause", "partition"], "rate_per_s": 0.25},
        targets={"meshes": {"trainer": 4}, "hosts": 2, "client": True},
        faults=records,
        events=events,
        invariants=[
            InvariantResult("progress", True, "1234 steps"),
            InvariantResult("no_leaks", False, "2 procs left", builtin=True),
        ],
        workload_stats={"steps": 1234, "max_step_gap_s": 0.4, "clients": 2},
    )


def loaded(report: RunReport) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(report.to_dict()))
    return data


# --- round trip ------------------------------------------------------------------------------


@SETTINGS
@given(reports())
def test_json_round_trip(report: RunReport) -> None:
    data = report.to_dict()
    assert data["schema"] == REPORT_SCHEMA
    assert list(data) == [
        "schema",
        "ok",
        "seed",
        "replay",
        "workload",
        "started_at",
        "wall_s",
        "schedule",
        "targets",
        "faults",
        "events",
        "percentiles",
        "by_kind",
        "invariants",
        "workload_stats",
    ]
    reloaded = json.loads(json.dumps(data))
    validate_report(reloaded)
    rebuilt = RunReport.from_dict(reloaded)
    assert rebuilt.to_dict() == data
    assert rebuilt == report
    assert [r.planned.target for r in rebuilt.faults] == [r.planned.target for r in report.faults]
    assert [r.planned.fault for r in rebuilt.faults] == [r.planned.fault for r in report.faults]


def test_to_json_writes_the_file(tmp_path: Path) -> None:
    report = example_report()
    path = tmp_path / "report.json"
    text = report.to_json(path)
    assert path.read_text(encoding="utf-8") == text + "\n"
    assert json.loads(text) == report.to_dict()
    assert text.startswith('{\n  "schema": "meshvisor.chaos/1",\n  "ok": false,')
    assert report.to_json() == text
    assert not (tmp_path / "None").exists()


def test_to_json_refuses_non_finite_numbers() -> None:
    report = example_report()
    report.wall_s = math.nan
    with pytest.raises(ValueError):
        report.to_json()


def test_from_dict_names_a_wrong_schema() -> None:
    data = loaded(example_report())
    data["schema"] = "meshvisor.chaos/2"
    with pytest.raises(ValueError, match=r"^schema: 'meshvisor\.chaos/2' is not"):
        RunReport.from_dict(data)
    del data["schema"]
    with pytest.raises(ValueError, match=r"^schema: required key is missing"):
        RunReport.from_dict(data)


def test_derived_fields() -> None:
    data = example_report().to_dict()
    first = data["faults"][0]
    assert first["description"] == "kill SIGSEGV"
    assert first["target_description"] == "rank 3 of mesh 'trainer'"
    assert first["detect_s"] == pytest.approx(0.04)
    assert first["recover_s"] == pytest.approx(1.5)
    # Only injected faults with a value count: one detection, one recovery.
    assert data["percentiles"]["detect_s"]["count"] == 1
    assert data["percentiles"]["recover_s"]["p99"] == pytest.approx(1.5)
    assert list(data["by_kind"]) == ["kill", "pause", "partition"]
    assert data["by_kind"]["pause"]["count"] == 1
    assert data["by_kind"]["pause"]["detect_s"] == percentiles([])
    assert data["by_kind"]["kill"]["detect_s"]["max"] == pytest.approx(0.04)


# --- the validator ---------------------------------------------------------------------------


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        node: Any = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return mutate


def _delete(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        node: Any = data
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return mutate


BROKEN: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "verdict",
        _set(("faults", 1, "verdict"), "maybe"),
        r"^faults\[1\]\.verdict: 'maybe' is not one of 'ok', 'missed', 'wrong_kind', "
        r"'not_healed', 'not_injected'$",
    ),
    ("fault kind", _set(("faults", 0, "fault", "kind"), "explode"), r"^faults\[0\]\.fault\.kind: "),
    (
        "target level",
        _set(("faults", 2, "target", "level"), "rack"),
        r"^faults\[2\]\.target\.level",
    ),
    ("missing seed", _delete(("seed",)), r"^seed: required key is missing$"),
    ("string seed", _set(("seed",), "42"), r"^seed: expected an integer, got string '42'$"),
    ("bool seed", _set(("seed",), True), r"^seed: expected an integer, got boolean"),
    ("unknown key", _set(("verdict",), "ok"), r"^verdict: unexpected key$"),
    ("negative wall", _set(("wall_s",), -1.0), r"^wall_s: expected a number >= 0"),
    ("bad time", _set(("started_at",), "yesterday"), r"^started_at: 'yesterday' is not an ISO"),
    ("local time", _set(("started_at",), "2024-05-01T10:00:00+02:00"), r"^started_at: .* UTC"),
    ("naive time", _set(("started_at",), "2024-05-01T10:00:00"), r"^started_at: .* UTC"),
    ("event time", _set(("events", 1, "at_s"), "soon"), r"^events\[1\]\.at_s: expected a number"),
    ("event fault", _set(("events", 1, "fault"), 7), r"^events\[1\]\.fault: 7 is not the index"),
    ("held", _set(("invariants", 0, "held"), "yes"), r"^invariants\[0\]\.held: expected a boolean"),
    ("faults type", _set(("faults",), {}), r"^faults: expected an array, got an object$"),
    (
        "expected",
        _set(("faults", 0, "expected_events", 0), 3),
        r"^faults\[0\]\.expected_events\[0\]",
    ),
    ("detect", _set(("faults", 0, "detect_s"), "fast"), r"^faults\[0\]\.detect_s: expected a"),
    ("note", _delete(("faults", 2, "note")), r"^faults\[2\]\.note: required key is missing$"),
    (
        "probability",
        _set(("faults", 1, "fault", "probability"), 2),
        r"fault\.probability: .*\[0, 1\]",
    ),
    ("duplicate index", _set(("faults", 1, "index"), 0), r"^faults\[1\]\.index: 0 repeats"),
    ("pct", _set(("percentiles", "detect_s", "p50"), "x"), r"^percentiles\.detect_s\.p50: "),
    ("pct null", _set(("percentiles", "detect_s", "p90"), None), r"^percentiles\.detect_s\.p90: "),
    (
        "pct count",
        _set(("percentiles", "recover_s", "count"), -1),
        r"^percentiles\.recover_s\.count",
    ),
    (
        "by kind",
        _set(("by_kind", "explode"), {}),
        r"^by_kind\.explode: 'explode' is not a fault kind",
    ),
    ("kind count", _delete(("by_kind", "kill", "count")), r"^by_kind\.kill\.count: required key"),
    ("ok", _set(("ok",), True), r"^ok: is True but must be False"),
    ("stats", _set(("workload_stats",), [1]), r"^workload_stats: expected an object"),
    ("nan", _set(("faults", 0, "at_s"), math.inf), r"^faults\[0\]\.at_s: expected a finite number"),
]


def test_the_example_is_valid() -> None:
    validate_report(loaded(example_report()))


@pytest.mark.parametrize(("mutate", "message"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_validate_report_names_the_bad_field(
    mutate: Callable[[dict[str, Any]], None], message: str
) -> None:
    data = loaded(example_report())
    mutate(data)
    with pytest.raises(ValueError, match=message):
        validate_report(data)
    with pytest.raises(ValueError, match=message):
        RunReport.from_dict(data)


def test_validate_report_rejects_a_non_object() -> None:
    with pytest.raises(ValueError, match="expected an object"):
        validate_report([])  # type: ignore[arg-type]


def test_ok_without_invariants_must_be_false() -> None:
    data = loaded(example_report())
    data["invariants"] = []
    validate_report(copy.deepcopy(data) | {"ok": False})
    with pytest.raises(ValueError, match=r"^ok: .*no invariant was checked"):
        validate_report(data | {"ok": True})


# --- percentiles -----------------------------------------------------------------------------


def test_percentiles_nearest_rank() -> None:
    assert percentiles([float(v) for v in range(1, 11)]) == {
        "count": 10,
        "p50": 5.0,
        "p90": 9.0,
        "p99": 10.0,
        "max": 10.0,
        "mean": 5.5,
    }
    hundred = percentiles([float(v) for v in range(100, 0, -1)])
    assert (hundred["p50"], hundred["p90"], hundred["p99"], hundred["max"]) == (50, 90, 99, 100)
    assert percentiles([5.0, 1.0, 4.0, 2.0, 3.0])["p50"] == 3.0
    assert percentiles([0.25]) == {
        "count": 1,
        "p50": 0.25,
        "p90": 0.25,
        "p99": 0.25,
        "max": 0.25,
        "mean": 0.25,
    }
    two = percentiles([2.0, 1.0])
    assert (two["p50"], two["p90"], two["mean"]) == (1.0, 2.0, 1.5)


def test_percentiles_of_nothing() -> None:
    assert percentiles([]) == {
        "count": 0,
        "p50": None,
        "p90": None,
        "p99": None,
        "max": None,
        "mean": None,
    }


@SETTINGS
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=200))
def test_percentiles_definition(values: list[float]) -> None:
    result = percentiles(values)
    n = len(values)
    assert result["count"] == n
    for key, p in (("p50", 50), ("p90", 90), ("p99", 99)):
        x = result[key]
        assert x in values
        rank = math.ceil(p * n / 100)
        # The smallest value with at least p % of the values at or below it.
        assert sum(v <= x for v in values) >= rank
        assert sum(v < x for v in values) < rank
    assert result["max"] == max(values)
    assert result["mean"] == pytest.approx(sum(values) / n, abs=1e-6)


# --- ok --------------------------------------------------------------------------------------


def test_ok_semantics() -> None:
    report = example_report()
    assert not report.ok
    assert report.to_dict()["ok"] is False
    report.invariants = [InvariantResult("a", True), InvariantResult("b", True)]
    assert report.ok
    assert report.to_dict()["ok"] is True
    report.invariants = []
    assert not report.ok
    assert report.to_dict()["ok"] is False
    report.invariants = [InvariantResult("a", False)]
    assert not report.ok


# --- rendering -------------------------------------------------------------------------------


def test_render_text_of_a_failed_run() -> None:
    report = example_report()
    text = render_text(report)
    assert "\x1b" not in text
    assert "seed 1234567" in text
    assert report.replay in text.splitlines()[0]
    for heading in ("Timeline", "Recovery", "Invariants"):
        assert heading in text
    for description in ("kill SIGSEGV", "pause 1.5 s", "partition 2 s"):
        assert description in text
    for verdict in ("ok", "missed", "not_injected", "unexpected"):
        assert re.search(rf"│ {verdict}\s*│", text), verdict
    assert "host 1 is gone" in text
    assert "[boom]" in text  # not taken for rich markup
    assert "✓" in text and "✗" in text
    assert "40.0" in text and "1500.0" in text  # detect and recover of fault 0, in ms
    assert text.rstrip().splitlines()[-1] == "FAILED: 1 invariant did not hold"
    assert max(len(line) for line in text.splitlines()) <= 120
    # The attributed event is shown with its fault, not as unexpected.
    assert text.count("unexpected") == 1


def test_render_text_shows_the_evidence_of_events_first_ones_first() -> None:
    """The stack of a hung rank is shown under the timeline, for the first few events."""
    report = example_report()
    stack = 'Thread 0x01 (most recent call first):\n  File "train.py", line 9 in all_reduce'
    report.events = [
        ObservedEvent(3.0 + i, "hung", "trainer", i, 0, 100 + i, "hung", fault=1, evidence=stack)
        for i in range(5)
    ]
    text = render_text(report)
    evidence = text[text.index("Evidence (the root cause of each event, trimmed)") :]
    assert evidence.index("#1 hung trainer rank 0 pid 100:") < evidence.index("in all_reduce")
    assert evidence.count("in all_reduce") == 3
    assert "... 2 more event(s) with evidence in the JSON report" in evidence
    assert text.index("Timeline") < text.index("Evidence") < text.index("Recovery")


def test_a_report_without_evidence_keys_still_loads() -> None:
    """Reports written before events had `evidence` are still valid."""
    data = loaded(example_report())
    for event in data["events"]:
        del event["evidence"]
    validate_report(data)
    assert RunReport.from_dict(data).events[0].evidence == ""


def test_render_text_verdict_lines() -> None:
    report = example_report()
    report.invariants = [InvariantResult("progress", True, "ok")]
    assert render_text(report).rstrip().splitlines()[-1] == "PASSED: every invariant held"
    report.invariants = [InvariantResult("a", False), InvariantResult("b", False)]
    assert render_text(report).rstrip().splitlines()[-1] == "FAILED: 2 invariants did not hold"
    report.invariants = []
    assert render_text(report).rstrip().splitlines()[-1].startswith("FAILED:")


def test_render_writes_on_the_given_console() -> None:
    console = Console(record=True, width=120, color_system=None)
    with console.capture() as capture:
        render(example_report(), console)
    assert "FAILED: 1 invariant did not hold" in capture.get()


@SETTINGS
@given(reports())
def test_render_text_shows_every_fault(report: RunReport) -> None:
    text = render_text(report)
    timeline = text[: text.index("\nRecovery (ms)")]
    seed = "none" if report.seed is None else str(report.seed)
    assert f"seed {seed}" in text.splitlines()[0]
    for record in report.faults:
        assert record.planned.fault.describe() in text
    # The verdict is the last column of the timeline; continuation lines leave it empty.
    verdicts = re.findall(r"│ (\w+)\s*│$", timeline, flags=re.MULTILINE)
    expected: list[str] = [r.verdict for r in report.faults]
    expected += ["unexpected"] * sum(e.fault is None for e in report.events)
    assert sorted(verdicts) == sorted(expected)
    # Only the header (it holds the replay command) may be wider than the console.
    body = text[text.index("\nTimeline") :]
    assert max(cell_len(line) for line in body.splitlines()) <= 120
    final = text.rstrip().splitlines()[-1]
    assert final.startswith("PASSED:" if report.ok else "FAILED:")


def test_every_fault_kind_is_covered() -> None:
    # The validator's fault fields follow the model's: one of each kind validates.
    report = example_report()
    report.faults = [
        FaultRecord(i, PlannedFault(float(i), fault, Target.client()), ())
        for i, fault in enumerate(
            [
                Fault.kill(),
                Fault.pause(1),
                Fault.raise_in("step"),
                Fault.drop(0.5, 1),
                Fault.delay(10, 1),
                Fault.partition(1),
                Fault.kill_agent(),
                Fault.kill_client(),
                Fault.kill_node(),
                Fault.preempt(),
            ]
        )
    ]
    report.faults[-1] = FaultRecord(9, PlannedFault(9.0, Fault.preempt(), Target.job()), ())
    report.events = []
    data = loaded(report)
    validate_report(data)
    assert list(data["by_kind"]) == list(FAULT_KINDS)
