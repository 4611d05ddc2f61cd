"""Chaos on SLURM (a real private cluster): a run whose hosts are the nodes of a SLURM job,
with the node-level faults: a lost node (``kill_node``: its slurmd and every process of it
killed, then brought back with its agent at the same address) and a preemption notice
(``preempt``: the job's warning signal). Node faults on a run without SLURM are refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from chaos_leftovers import clean_up, nothing_left_behind, snapshot  # noqa: F401 (autouse fixture)

from chaos import (
    ChaosOptions,
    ChaosSetupError,
    Fault,
    PlannedFault,
    RandomSchedule,
    RunReport,
    ScriptedSchedule,
    Target,
    render_text,
    replay_command,
    run_chaos,
    validate_report,
)
from mesh.testing import settings

pytestmark = pytest.mark.timeout(180)

TESTS = Path(__file__).resolve().parent
COUNTERS = f"{TESTS / 'chaos_workloads.py'}:counters"
#: `counters` runs two ranks per host: ranks 2 and 3 are on host 1.
RANKS_OF_HOST_1 = {2, 3}

NODE_FAULTS = ScriptedSchedule(
    (
        PlannedFault(1.0, Fault.kill_node(), Target.of_host(1)),
        PlannedFault(5.0, Fault.preempt(), Target.job()),
    )
)


@pytest.fixture(params=["local", "env"])
def node_faults(request: pytest.FixtureRequest, slurm: Any, tmp_path: Path) -> RunReport:
    """`counters` on a SLURM job of the session's cluster, through both node faults: run as
    on the cluster itself (a lost node is a lost machine) and as on any SLURM ("env": only
    the node's agent step is lost), with job directories under `tmp_path`."""
    lines: list[str] = []
    before = snapshot()
    where = slurm if request.param == "local" else "env"
    try:
        with settings(home=str(tmp_path / "home")):
            report = run_chaos(
                COUNTERS, NODE_FAULTS, ChaosOptions(hosts=2, slurm=where, on_update=lines.append)
            )
    finally:
        print("\n".join(lines))
        left = clean_up(before)
    print(render_text(report))
    assert not left, left
    data = json.loads(report.to_json())
    validate_report(data)
    assert RunReport.from_dict(data).to_dict() == data
    assert not slurm.run(["squeue", "-h"]).stdout.strip(), "the run's job is still in squeue"
    assert not list(tmp_path.glob("home/slurm/*")), "the run's job directory is left"
    return report


def test_a_run_on_slurm_sees_and_heals_a_lost_node_and_a_preemption_notice(
    node_faults: RunReport,
) -> None:
    report = node_faults
    assert report.ok, render_text(report)
    assert report.targets["job"] is True and report.targets["hosts"] == 2
    lost, notice = report.faults
    assert (lost.planned.fault.kind, lost.verdict) == ("kill_node", "ok"), lost
    assert lost.expected == ("unreachable",) and set(lost.observed) == {"unreachable"}
    lost_events = [e for e in report.events if e.fault == lost.index]
    assert {e.rank for e in lost_events} == RANKS_OF_HOST_1, lost_events
    assert all("on host n" in e.message for e in lost_events), lost_events  # names the node
    assert lost.detect_s is not None and lost.recover_s is not None
    assert 0 <= lost.detect_s <= lost.recover_s, lost
    print(f"kill_node: event after {lost.detect_s:.2f} s, answering after {lost.recover_s:.2f} s")
    assert (notice.planned.fault.kind, notice.verdict) == ("preempt", "ok"), notice
    assert notice.expected == ("preempting",) and set(notice.observed) == {"preempting"}
    notices = [e for e in report.events if e.fault == notice.index]
    assert sorted(e.rank for e in notices) == [0, 1, 2, 3], notices  # every rank is told
    assert notice.detect_s is not None and notice.recover_s is not None, notice
    text = render_text(report)
    assert "kill node" in text and "preemption notice" in text and "job" in text
    assert report.to_dict()["by_kind"].keys() == {"kill_node", "preempt"}
    assert report.replay.endswith(("--slurm local", "--slurm env")), report.replay


def test_node_faults_on_a_run_without_slurm_are_refused_before_anything_starts() -> None:
    with pytest.raises(ChaosSetupError) as caught:
        run_chaos(COUNTERS, NODE_FAULTS, ChaosOptions(hosts=2))
    message = str(caught.value)
    assert "kill_node, preempt act on SLURM's nodes and jobs" in message, message
    assert "--slurm local" in message, message
    mix = RandomSchedule.from_mix(0, 1.0, 5.0, "kill,kill_node")
    with pytest.raises(ChaosSetupError, match="the fault kinds kill_node act on SLURM"):
        run_chaos(COUNTERS, mix, ChaosOptions(hosts=2))


def test_the_command_line_refuses_node_faults_without_slurm() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "chaos", "run", COUNTERS, "--faults", "preempt", "--duration", "3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "preempt act on SLURM's nodes and jobs" in done.stderr + done.stdout, done


def test_the_replay_line_says_where_the_run_was() -> None:
    schedule = RandomSchedule(seed=3, mtbf_s=1.0, duration_s=5.0, faults=(("preempt", 1.0),))
    line = replay_command("w.py", schedule, ChaosOptions(slurm="env", slurm_partition="gpu"))
    assert line.endswith("--hosts 2 --slurm env --partition gpu"), line
