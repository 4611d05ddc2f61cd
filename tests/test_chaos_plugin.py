"""The pytest plugin (the ``chaos`` marker and fixture, ``--chaos-seed``, ``--chaos-report``),
through inner pytest runs in subprocesses (pytester) that run real chaos runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from chaos_leftovers import nothing_left_behind, run_base  # noqa: F401 (autouse fixture)

from chaos import validate_report

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.timeout(150)

TESTS = Path(__file__).resolve().parent
COUNTERS = f"{TESTS / 'chaos_workloads.py'}:counters"
BROKEN = f"{TESTS / 'chaos_workloads_extra.py'}:broken_invariants"
INNER_TIMEOUT_S = 120.0

PASSING = f"""
import pytest

@pytest.mark.chaos(mtbf=1.0, duration=3, faults="kill")
def test_survives_kills(chaos):
    report = chaos.run({COUNTERS!r})
    assert report.ok
    assert report.seed == chaos.seed
    assert [r.planned.fault.kind for r in report.faults] == ["kill"] * len(report.faults)
"""

FAILING = f"""
import pytest

@pytest.mark.chaos(seed=2, mtbf=1000.0, duration=1.5, faults="kill")
def test_broken_invariants(chaos):
    chaos.run({BROKEN!r})
"""

UNKNOWN_OPTION = f"""
import pytest

@pytest.mark.chaos(mtbf=1.0, duration=3, bogus_option=4)
def test_with_a_typo(chaos):
    chaos.run({COUNTERS!r})
"""


def inner(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    """Run `source` as a test file in a pytest subprocess (this session's XDG_RUNTIME_DIR, so
    its chaos runs go under the private base the leak checks look at)."""
    assert os.environ["XDG_RUNTIME_DIR"] == run_base()
    pytester.makepyfile(test_inner=source)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        f"--timeout={INNER_TIMEOUT_S - 10:g}",
        *args,
        timeout=INNER_TIMEOUT_S,
    )
    print(result.stdout.str())
    print(result.stderr.str())
    return result


def reports_in(directory: Path) -> list[dict[str, object]]:
    reports = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        validate_report(data)
        reports.append(data)
    return reports


def test_marker_and_fixture_run_a_passing_chaos_test(pytester: pytest.Pytester) -> None:
    out = pytester.path / "reports"
    result = inner(pytester, PASSING, "-rP", "--chaos-report", str(out))
    result.assert_outcomes(passed=1)
    assert result.ret == 0
    # -rP shows the report the fixture attached to the test.
    result.stdout.fnmatch_lines(["*chaos report*", "*seed 0*", "*PASSED: every invariant held*"])
    [data] = reports_in(out)
    assert data["ok"] is True
    assert data["seed"] == 0  # no --chaos-seed and no seed in the marker
    assert data["workload"] == COUNTERS
    schedule = data["schedule"]
    assert isinstance(schedule, dict)
    assert (schedule["mtbf_s"], schedule["duration_s"], schedule["mix"]) == (1.0, 3, "kill:1")
    assert [path.name for path in out.glob("*.json")] == [
        "test_inner.py_test_survives_kills-1.json"
    ]


def test_a_failed_invariant_fails_the_test_with_the_report(pytester: pytest.Pytester) -> None:
    out = pytester.path / "reports"
    result = inner(pytester, FAILING, "--chaos-seed", "5", "--chaos-report", str(out))
    result.assert_outcomes(failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    text = result.stdout.str()
    assert "chaos invariants did not hold" in text
    assert "replay: meshvisor chaos run" in text
    # --chaos-seed wins over the marker's seed, and the replay command says so.
    assert "--seed 5" in text and "--seed 2" not in text
    assert "seed 5" in text
    assert "the ledger is off by 3" in text
    assert "FAILED: 3 invariants did not hold" in text
    [data] = reports_in(out)  # a failed run's report is written too
    assert data["ok"] is False
    assert data["seed"] == 5


def test_an_unknown_marker_option_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = inner(pytester, UNKNOWN_OPTION)
    assert result.ret != pytest.ExitCode.OK
    output = result.stdout.str() + result.stderr.str()
    assert "unknown chaos marker option(s) bogus_option" in output
    assert "UsageError" in output
    assert "mtbf" in output  # the known options are listed
    result.assert_outcomes(errors=1)
