"""SlurmJob against a real private SLURM cluster (slurmctld + 4 slurmd): allocate, call, fail."""

from __future__ import annotations

import os
from typing import Any

import pytest

from job import SlurmError, SlurmJob
from mesh import Actor, endpoint

pytestmark = pytest.mark.timeout(120)


class Where(Actor):
    @endpoint
    def node(self) -> str | None:
        return os.environ.get("SLURMD_NODENAME")


def test_a_job_of_two_meshes_gives_host_meshes_whose_actors_run_on_their_nodes(slurm: Any) -> None:
    lines: list[str] = []
    job = SlurmJob(
        {"trainers": 3, "spare": 1}, name="two-meshes", job_dir=slurm.jobs, progress=lines.append
    )
    try:
        state = job.state(timeout_s=60)
        assert dict(state.nodes) == {"trainers": ("n1", "n2", "n3"), "spare": ("n4",)}
        assert state.trainers.sizes == {"hosts": 3} and state["spare"].sizes == {"hosts": 1}
        for name, nodes in state.nodes.items():
            procs = state[name].spawn_procs({"gpus": 1}, name=f"{name}-procs")
            where = procs.spawn("where", Where)
            assert list(where.node.call().get(timeout=30).values()) == list(nodes)
            procs.stop().get(timeout=30)
        assert job.slurm_state() == "RUNNING"
        assert any("queued" in line or "starting" in line for line in lines), lines
        assert any("4 of 4 agents up" in line for line in lines), lines
    finally:
        job.cancel()
    assert slurm.run(["squeue", "-h", "-j", str(job.job_id)], check=False).stdout.strip() == ""


def test_a_job_that_cannot_start_fails_quoting_slurm(slurm: Any) -> None:
    job = SlurmJob({"hosts": 1}, partition="no-such-partition", job_dir=slurm.jobs, progress=None)
    with pytest.raises(SlurmError, match=r"(?i)invalid partition"):
        job.state(timeout_s=30)


def test_a_job_asking_for_more_nodes_than_the_partition_has_fails_with_slurms_reason(
    slurm: Any,
) -> None:
    job = SlurmJob({"hosts": 9}, job_dir=slurm.jobs, progress=None)
    with pytest.raises(SlurmError, match=r"(?i)PartitionConfig|node"):
        job.state(timeout_s=30)
