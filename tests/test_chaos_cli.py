"""``python -m chaos run`` and ``meshvisor chaos run`` end to end, each in a subprocess: the
exit status (0 passed, 1 an invariant failed, 2 a usage or setup error), the rendered report
and the JSON report it writes. Every run leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from chaos_leftovers import nothing_left_behind, run_base  # noqa: F401 (autouse fixture)

from chaos import validate_report

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parent.parent
COUNTERS = "tests/chaos_workloads.py:counters"  # relative: the CLI runs in the checkout
BROKEN = "tests/chaos_workloads_extra.py:broken_invariants"
RUN_TIMEOUT_S = 120.0
#: A short run with (almost surely) no fault: for runs whose point is elsewhere.
QUIET = ["--mtbf", "1000", "--duration", "1.5", "--faults", "kill"]


def cli(
    *args: str | Path, command: tuple[str, ...] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the chaos CLI (``python -m chaos`` unless `command` is given) in the checkout, with
    this session's private XDG_RUNTIME_DIR."""
    env = dict(os.environ, XDG_RUNTIME_DIR=run_base(), COLUMNS="160")
    env.pop("MESHVISOR_LOG_LEVEL", None)
    proc = subprocess.run(
        [*(command or (sys.executable, "-m", "chaos")), *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    print(f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def meshvisor_command() -> tuple[str, ...]:
    """The installed console script, or its entry point run by this interpreter."""
    script = shutil.which("meshvisor")
    if script is not None:
        return (script,)
    return (sys.executable, "-c", "import sys; from meshvisor._cli import main; sys.exit(main())")


def check_passed_run(proc: subprocess.CompletedProcess[str], report: Path, seed: int) -> None:
    assert proc.returncode == 0, proc
    assert "PASSED" in proc.stdout
    assert "FAILED" not in proc.stdout
    assert f"seed {seed}" in proc.stdout
    assert f"report written to {report}" in " ".join(proc.stdout.split())
    data = json.loads(report.read_text(encoding="utf-8"))
    validate_report(data)
    assert data["ok"] is True
    assert data["seed"] == seed
    assert data["schedule"]["seed"] == seed
    assert data["schedule"]["mix"] == "kill:1,pause:1"
    assert f"--seed {seed}" in data["replay"]
    assert data["workload"] == COUNTERS
    assert data["workload_stats"]["steps"] > 0


RANDOM_RUN = ["--mtbf", "1", "--faults", "kill,pause", "--duration", "4"]


def test_python_m_chaos_run_passes_and_writes_the_report(tmp_path: Path) -> None:
    report = tmp_path / "out.json"
    proc = cli("run", COUNTERS, "--seed", "3", *RANDOM_RUN, "--report", report)
    check_passed_run(proc, report, 3)


def test_meshvisor_chaos_run_passes_and_writes_the_report(tmp_path: Path) -> None:
    report = tmp_path / "out.json"
    proc = cli(
        "chaos",
        "run",
        COUNTERS,
        "--seed",
        "3",
        *RANDOM_RUN,
        "--report",
        report,
        command=meshvisor_command(),
    )
    check_passed_run(proc, report, 3)


def test_a_failed_invariant_exits_1(tmp_path: Path) -> None:
    report = tmp_path / "out.json"
    proc = cli("run", BROKEN, "--seed", "7", *QUIET, "--report", report)
    assert proc.returncode == 1, proc
    assert "FAILED: 3 invariants did not hold" in proc.stdout
    assert "PASSED" not in proc.stdout
    assert "the ledger is off by 3" in proc.stdout
    data = json.loads(report.read_text(encoding="utf-8"))
    validate_report(data)
    assert data["ok"] is False
    assert data["seed"] == 7
    failed = {inv["name"] for inv in data["invariants"] if not inv["held"]}
    assert failed == {"the ledger balances", "the audit passes", "the flag is set"}


@pytest.mark.parametrize(
    ("faults", "message"),
    [
        ("kill,explode", "unknown fault kind 'explode' in 'explode'; known: kill, pause"),
        ("kill:zero", "bad weight in 'kill:zero'"),
        ("kill,,pause", "empty item in the fault mix"),
    ],
)
def test_a_bad_fault_mix_is_a_usage_error(tmp_path: Path, faults: str, message: str) -> None:
    report = tmp_path / "out.json"
    proc = cli("run", COUNTERS, "--faults", faults, "--report", report)
    assert proc.returncode == 2, proc
    assert message in proc.stderr
    assert not report.exists()


def test_a_missing_script_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    report = tmp_path / "out.json"
    proc = cli("run", "tests/no_such_script.py:workload", *QUIET, "--report", report)
    assert proc.returncode == 2, proc
    output = " ".join(proc.stdout.split())  # rich wraps long lines
    assert "chaos run could not start" in output
    assert "no_such_script.py does not exist" in output
    assert "Traceback" not in proc.stderr
    assert not report.exists()


def test_a_missing_subcommand_is_a_usage_error() -> None:
    proc = cli(command=(*meshvisor_command(), "chaos"))
    assert proc.returncode == 2, proc
    assert "run" in proc.stderr
