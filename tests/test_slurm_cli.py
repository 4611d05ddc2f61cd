"""``meshvisor slurm batch|cancel|list``, run as the real command line against the private SLURM
cluster: batch mode runs a client script inside its own allocation and ends with it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from polling import wait_until

from job import SlurmJob

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).parent.parent
CLIENT = Path(__file__).parent / "scripts" / "slurm_client.py"
T = 60.0


def meshvisor(*args: str, timeout_s: float = T) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "meshvisor", "slurm", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )


def job_record(slurm: Any, job_id: str) -> dict[str, str]:
    out = slurm.run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def in_squeue(slurm: Any, job_id: str) -> bool:
    return bool(slurm.run(["squeue", "-h", "-j", job_id], check=False).stdout.strip())


def submit_batch(slurm: Any, *args: str) -> tuple[str, Path]:
    """``meshvisor slurm batch ARGS``: the job id and output file it printed."""
    done = meshvisor("batch", "--job-dir", str(slurm.jobs), "--time", "5", *args)
    assert done.returncode == 0, done.stderr
    job_id = re.search(r"submitted SLURM job (\d+)", done.stdout)
    output = re.search(r"output in (\S+)", done.stdout)
    assert job_id and output, done.stdout
    return job_id.group(1), Path(output.group(1))


def tagged(output: Path, tag: str) -> list[Any]:
    return [
        json.loads(line.split(" ", 1)[1])
        for line in output.read_text().splitlines()
        if line.startswith(f"{tag} ")
    ]


def test_batch_runs_the_script_on_the_first_node_of_its_own_job_which_ends_with_it(
    slurm: Any,
) -> None:
    job_id, output = submit_batch(
        slurm,
        "--mesh",
        "workers=2",
        "--mesh",
        "spare=1",
        "--job-name",
        "batched",
        str(CLIENT),
        "batch",
    )
    wait_until(lambda: not in_squeue(slurm, job_id), T, f"batch job {job_id} to end")
    record = job_record(slurm, job_id)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", record
    assert record["JobName"] == "batched" and record["BatchHost"] == "n1"
    assert tagged(output, "NODES") == [["n1", "n2"], ["n3"]], output.read_text()
    assert "client script ended with status 0" in output.read_text()


def test_a_failing_batch_script_fails_its_job_with_the_scripts_exit_status(slurm: Any) -> None:
    job_id, output = submit_batch(slurm, "--mesh", "hosts=1", str(CLIENT), "batch", "3")
    wait_until(lambda: not in_squeue(slurm, job_id), T, f"batch job {job_id} to end")
    record = job_record(slurm, job_id)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "3:0", record
    assert record["JobName"] == "slurm_client"  # named after the script
    assert tagged(output, "NODES") == [["n1"]]


def test_batch_refuses_bad_arguments_before_submitting(slurm: Any) -> None:
    bad_mesh = meshvisor("batch", "--job-dir", str(slurm.jobs), "--mesh", "workers", str(CLIENT))
    assert bad_mesh.returncode == 1 and "must be NAME=N" in bad_mesh.stderr
    missing = meshvisor("batch", "--job-dir", str(slurm.jobs), "--mesh", "w=1", "/no/such.py")
    assert missing.returncode == 1 and "/no/such.py does not exist" in missing.stderr
    bad_time = meshvisor(
        "batch", "--job-dir", str(slurm.jobs), "--mesh", "w=1", "--time", "soon", str(CLIENT)
    )
    assert bad_time.returncode == 1 and "not a SLURM duration" in bad_time.stderr
    bad_partition = meshvisor(
        "batch", "--job-dir", str(slurm.jobs), "--mesh", "w=1", "--partition", "nope", str(CLIENT)
    )
    assert bad_partition.returncode == 1
    assert re.search(r"(?i)sbatch failed.*invalid partition", bad_partition.stderr)
    assert not list(slurm.jobs.iterdir())  # nothing was left behind
    assert slurm.run(["squeue", "-h"]).stdout.strip() == ""


def test_list_shows_each_job_with_slurms_state_and_prunes_the_forgotten_ones(slurm: Any) -> None:
    kept = SlurmJob(
        {"trainers": 2, "spare": 1}, name="kept", persistent=True, job_dir=slurm.jobs, progress=None
    ).apply()
    ended = SlurmJob({"w": 1}, name="ended", persistent=True, job_dir=slurm.jobs, progress=None)
    ended.apply().cancel()
    assert kept.directory and ended.directory
    forgotten = slurm.jobs / "forgotten-0000"  # a job SLURM no longer knows
    shutil.copytree(ended.directory, forgotten)
    spec = json.loads((forgotten / "job.json").read_text())
    (forgotten / "job.json").write_text(
        json.dumps({**spec, "name": "forgotten", "job_id": "987654"})
    )
    wait_until(lambda: kept.slurm_state() == "RUNNING", T, "the job to run")

    listed = meshvisor("list", "--job-dir", str(slurm.jobs))
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[1:]}
    assert listed.stdout.split()[:3] == ["NAME", "JOB", "ID"]
    assert rows["kept"] == [
        "kept",
        kept.job_id,
        "RUNNING",
        "trainers=2,spare=1",
        "yes",
        str(kept.directory),
    ]
    assert rows["ended"][1:3] == [ended.job_id, "CANCELLED"]
    assert rows["forgotten"][1:3] == ["987654", "FORGOTTEN"]

    pruned = meshvisor("list", "--prune", "--job-dir", str(slurm.jobs))
    assert "pruned 1 jobs SLURM forgot: forgotten (987654)" in pruned.stdout
    assert "forgotten-0000" not in pruned.stdout and not forgotten.exists()
    assert kept.directory.exists() and ended.directory.exists()
    kept.cancel()


def test_cancel_ends_a_job_by_name_or_id_and_says_so_for_one_already_ended(slurm: Any) -> None:
    jobs = [
        SlurmJob({"w": 1}, name=name, persistent=True, job_dir=slurm.jobs, progress=None).apply()
        for name in ("by-name", "by-id")
    ]
    for job in jobs:
        wait_until(lambda job=job: job.slurm_state() == "RUNNING", T, "the job to run")
    by_name = meshvisor("cancel", "by-name", "--job-dir", str(slurm.jobs))
    assert by_name.returncode == 0, by_name.stderr
    assert f"cancelled SLURM job {jobs[0].job_id} (by-name)" in by_name.stdout
    assert not in_squeue(slurm, str(jobs[0].job_id))
    by_id = meshvisor("cancel", str(jobs[1].job_id), "--job-dir", str(slurm.jobs))
    assert by_id.returncode == 0 and f"cancelled SLURM job {jobs[1].job_id}" in by_id.stdout
    assert not in_squeue(slurm, str(jobs[1].job_id))
    again = meshvisor("cancel", "by-id", "--job-dir", str(slurm.jobs))
    assert again.returncode == 0 and "had already ended (CANCELLED)" in again.stdout
    unknown = meshvisor("cancel", "nobody", "--job-dir", str(slurm.jobs))
    assert unknown.returncode == 1
    assert "no meshvisor SLURM job has the id or name 'nobody'" in unknown.stderr
