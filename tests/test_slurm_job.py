"""SlurmJob against a real private SLURM cluster (slurmctld + 4 slurmd): allocate, call, fail."""

from __future__ import annotations

import os
import re
from pathlib import Path
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


def _record(slurm: Any, job: SlurmJob) -> dict[str, str]:
    out = slurm.run(["scontrol", "show", "job", "-o", str(job.job_id)]).stdout
    return dict(re.findall(r"(BatchFlag|JobState)=(\S+)", out))


def _processes_naming(directory: Path | None) -> list[int]:
    """The processes whose command line names `directory` (a job's salloc and batch process)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if entry.isdigit() and str(directory).encode() in cmdline:
            found.append(int(entry))
    return found


def test_a_job_its_client_ends_is_granted_at_once_one_outliving_it_is_a_batch_job(
    slurm: Any,
) -> None:
    lines: list[str] = []
    options: dict[str, Any] = {"job_dir": slurm.jobs, "progress": lines.append}
    at_once = SlurmJob({"hosts": 1}, name="at-once", **options)
    kept = SlurmJob({"hosts": 1}, name="kept", persistent=True, **options)
    sbatch_only = SlurmJob(
        {"hosts": 1}, name="sbatch-only", slurm_args=["--open-mode=append"], **options
    )
    try:
        at_once.apply()  # salloc: granted in the request, so it runs when apply returns
        assert _record(slurm, at_once) == {"JobState": "RUNNING", "BatchFlag": "0"}
        assert at_once.output_file is not None and "Granted job allocation" in (
            at_once.output_file.read_text()
        )
        kept.apply()
        assert _record(slurm, kept)["BatchFlag"] == "1"
        sbatch_only.apply()  # an option salloc refuses: submitted as a batch job
        assert _record(slurm, sbatch_only)["BatchFlag"] == "1"
        assert any("unrecognized option '--open-mode=append'" in line for line in lines), lines
        assert not (sbatch_only.directory / "salloc.out").exists()  # type: ignore[operator]
    finally:
        for job in (at_once, kept, sbatch_only):
            job.cancel()
    assert _processes_naming(at_once.directory) == []  # salloc and its batch process ended
