"""SLURM's commands, run with bounded time; failures become `SlurmError`s quoting SLURM."""

from __future__ import annotations

import getpass
import shutil
import subprocess
from collections.abc import Sequence

from job._formats import expand_hostlist, parse_job_id, parse_records

#: How long one SLURM command may take (slurmctld answers in milliseconds when it is up).
COMMAND_TIMEOUT_S = 30.0


class SlurmError(RuntimeError):
    """A SLURM command failed, or a job could not start; the message quotes SLURM."""


def run_slurm(command: Sequence[str], *, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
    """Run a SLURM command and return what it printed; SlurmError quoting its error if it
    fails, is missing or does not answer within `timeout_s`."""
    program = command[0]
    if shutil.which(program) is None:
        raise SlurmError(
            f"{program} is not installed here: SLURM's client commands (sbatch, squeue, "
            "scontrol, scancel) must be on PATH to use a SlurmJob"
        )
    try:
        done = subprocess.run(
            list(command), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"{' '.join(command[:3])} did not answer within {timeout_s:g} s: is slurmctld up?"
        ) from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()
        raise SlurmError(f"{program} failed (exit status {done.returncode}): {' / '.join(said)}")
    return done.stdout


def submit(arguments: Sequence[str], script: str) -> str:
    """``sbatch --parsable ARGUMENTS SCRIPT``; the new job's id."""
    return parse_job_id(run_slurm(["sbatch", "--parsable", *arguments, script]))


def job_record(job_id: str) -> dict[str, str] | None:
    """``scontrol show job -o JOB`` as a dict, or None once SLURM has forgotten the job."""
    try:
        text = run_slurm(["scontrol", "show", "job", "-o", job_id])
    except SlurmError as error:
        if "Invalid job id" in str(error):
            return None
        raise
    records = parse_records(text)
    return records[0] if records else None


def node_records(nodes: str) -> dict[str, dict[str, str]]:
    """``scontrol show node -o NODES`` (a host list, e.g. ``n[1-4]``) by node name, in one
    call; empty if SLURM does not know them."""
    try:
        records = parse_records(run_slurm(["scontrol", "show", "node", "-o", nodes]))
    except SlurmError:
        return {}
    return {record["NodeName"]: record for record in records if "NodeName" in record}


def job_nodes(record: dict[str, str]) -> list[str]:
    """The nodes a running job holds, in SLURM's order."""
    nodes = record.get("NodeList", "")
    return expand_hostlist(nodes) if nodes and nodes != "None" else []


def job_states(job_ids: Sequence[str]) -> dict[str, str]:
    """SLURM's state of each of `job_ids` it still knows (``squeue --states=all``); a job it
    has forgotten (ended more than MinJobAge ago) is missing from the answer."""
    if not job_ids:
        return {}
    wanted = set(job_ids)
    states = {}
    for line in run_slurm(["squeue", "-h", "--states=all", "-o", "%i %T"]).splitlines():
        job_id, _, state = line.strip().partition(" ")
        if job_id in wanted:
            states[job_id] = state.strip()
    return states


def jobs_named(name: str) -> list[str]:
    """The ids of this user's queued or running jobs called `name`, newest first."""
    user = getpass.getuser()
    out = run_slurm(["squeue", "-h", f"--user={user}", f"--name={name}", "-o", "%i"])
    return sorted((line.strip() for line in out.splitlines() if line.strip()), key=int)[::-1]


def cancel(job_id: str, *, signal: str | None = None) -> None:
    """``scancel JOB`` (or send `signal` to all its steps); a job already gone is no error."""
    command = ["scancel", *([f"--signal={signal}"] if signal else []), job_id]
    try:
        run_slurm(command)
    except SlurmError as error:
        if "Invalid job id" not in str(error) and "already completing" not in str(error):
            raise
