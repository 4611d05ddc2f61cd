"""``meshvisor top --slurm-job``: the live view of a SLURM job's agents, found in its job
directory and reached with its keys, on the private SLURM cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from actors import Where

from job import SlurmJob

pytestmark = pytest.mark.timeout(240)
ROOT = str(Path(__file__).resolve().parents[1])
T = 60.0


def test_the_view_of_a_slurm_job_shows_each_node_and_its_procs(slurm: Any) -> None:
    job = SlurmJob({"hosts": 2}, name="watched", job_dir=slurm.jobs, progress=None)
    try:
        state = job.state(timeout_s=T)
        procs = state.hosts.spawn_procs({"gpus": 1}, name="on-nodes")
        where = procs.spawn("watchers", Where)
        pids = {pid for pid, _ in where.where.call().get(timeout=T).values()}
        command = [sys.executable, "-m", "meshvisor", "top", "--json"]
        command += ["--slurm-job", str(job.job_id), "--job-dir", str(slurm.jobs)]
        env = {**os.environ, "PYTHONPATH": ROOT}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=T)
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout)
        assert found["target"] == f"SLURM job {job.job_id} (watched)"
        assert sorted(host["host"] for host in found["hosts"]) == ["n1", "n2"]
        shown = {
            p["pid"] for host in found["hosts"] for p in host["procs"] if p["mesh"] == "on-nodes"
        }
        assert shown == pids
        procs.stop().get(timeout=T)
    finally:
        job.cancel()
