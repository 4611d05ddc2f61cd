"""examples/when_things_go_wrong.py, the README's walk-through of the debugging tools: the
deadlocked rank is reported as stuck with the stack where it waits, the rank that runs out of
memory as "oom" with its limit, and `meshvisor logs` shows each rank's lines afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "when_things_go_wrong.py"


class Ran(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    pid: int  # names the run's log directory


def run(*args: str, timeout_s: float = 120.0) -> Ran:
    """Run Python with `args` to its end. The suite's private XDG_RUNTIME_DIR and
    MESHVISOR_LOG_DIR come with os.environ."""
    with subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
        cwd=ROOT,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"{args} ran past {timeout_s} s:\n{out}\n{err}")
    return Ran(proc.returncode, out, err, proc.pid)


@pytest.mark.timeout(240)
def test_a_deadlocked_rank_is_reported_stuck_where_it_waits_and_its_lines_are_kept() -> None:
    job = run(str(EXAMPLE), "--interval", "0.1")
    assert job.returncode == 1, job.stderr
    report = job.stderr.split("Supervision report", 1)[1]
    assert "Root cause:" in report.splitlines()[2]
    assert "kind: stuck" in report and "rank: {'gpus': 2}" in report
    assert "in log_update" in report and "with self.lock" in report
    assert "[4 ranks" in job.stdout and "loss {" in job.stdout  # the ranks' lines, aggregated

    runs = sorted(Path(os.environ["MESHVISOR_LOG_DIR"]).glob(f"run-*-{job.pid}"))
    assert runs, "the example's run left no log directory"
    logs = run(
        "-m", "meshvisor", "logs", "--dir", str(runs[-1]), "--mesh", "trainers", "--rank", "2"
    )
    assert logs.returncode == 0, logs.stderr
    lines = [line for line in logs.stdout.splitlines() if "step" in line]
    assert [line.split("] ", 1)[1].split(" loss")[0] for line in lines] == [
        f"step {n}" for n in range(6)
    ]
    assert all("{'gpus': 2}" in line for line in lines)


@pytest.mark.timeout(240)
def test_a_rank_past_its_memory_limit_is_reported_out_of_memory() -> None:
    job = run(str(EXAMPLE), "--oom", "--interval", "0.1")
    assert job.returncode == 1, job.stderr
    report = job.stderr.split("Supervision report", 1)[1]
    assert "kind: oom" in report and "rank: {'gpus': 1}" in report
    assert "memory limit of 512.0 MiB" in report
    assert "in grow_buffers" in report and "MemoryError" in report
