"""A job that lives no longer than its client starts at once: ``salloc`` instead of ``sbatch``.

slurmctld grants an ``salloc`` allocation in the request that asks for it when the nodes are
free, where a batch job waits for the next scheduling pass (once a second: half a second on
average). ``salloc`` then runs the job's batch process (`job._batch`) here, beside the client,
and ends the job when it ends, as a batch script would. The batch process's ``srun`` steps
hold the agents, so they depend on processes on this machine: fine for a job the client's exit
cancels anyway, not for one that must outlive it (persistent, batch mode, requeued), which
stays a batch job. ``salloc`` runs in a session of its own (a Ctrl-C in the client's terminal
does not end the job) and writes to the job's output file, from which its job id is read.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

from job._jobdir import JobDir
from job._scheduler import COMMAND_TIMEOUT_S, SlurmError

#: sbatch's options that salloc does not take (the rest mean the same to both).
BATCH_ONLY = ("--requeue", "--no-requeue")
#: How salloc says which job it asked for: "Granted job allocation 7" or "Pending job ...".
_JOB_ID = re.compile(r"job allocation (\d+)")
#: How salloc refuses an option it does not know (one of sbatch's given in slurm_args).
_UNKNOWN_OPTION = re.compile(r"unrecognized option|invalid option|unknown option")
#: How often salloc's output is looked at until it names the job.
LOOK_EVERY_S = 0.005


class SallocRefusedOption(SlurmError):
    """salloc does not take one of the job's options: submit it as a batch job instead."""


def salloc_arguments(sbatch_arguments: Sequence[str]) -> list[str]:
    """The job's sbatch options as salloc takes them."""
    return [argument for argument in sbatch_arguments if argument not in BATCH_ONLY]


def allocate(
    arguments: Sequence[str], job_dir: JobDir, timeout_s: float = COMMAND_TIMEOUT_S
) -> tuple[str, subprocess.Popen[bytes]]:
    """Ask salloc for the job (options `arguments`) running the batch process of `job_dir`;
    its id and the salloc process, once SLURM took it (granted or queued). SlurmError quoting
    salloc if it refuses (SallocRefusedOption for an option it does not know)."""
    if shutil.which("salloc") is None:
        raise SlurmError(
            "salloc is not installed here: SLURM's client commands (salloc, sbatch, squeue, "
            "scontrol, scancel) must be on PATH to use a SlurmJob"
        )
    pending = job_dir.path / "salloc.out"
    fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as output:
        process = subprocess.Popen(
            ["salloc", *arguments, sys.executable, "-m", "job._batch", str(job_dir.path)],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    job_id = _job_id_from(pending, process, time.monotonic() + timeout_s)
    os.replace(pending, job_dir.output_file(job_id))  # salloc writes on to the same file
    return job_id, process


def _job_id_from(
    output: os.PathLike[str], process: subprocess.Popen[bytes], deadline: float
) -> str:
    """The job id salloc writes to `output`; SlurmError if it ends or is silent past
    `deadline` (`time.monotonic`) first."""
    while True:
        ended = process.poll() is not None
        with open(output, errors="replace") as handle:
            said = handle.read()
        found = _JOB_ID.search(said)
        if found:
            return found[1]
        if ended:
            lines = [line.strip() for line in said.strip().splitlines()] or ["no output"]
            error = SallocRefusedOption if _UNKNOWN_OPTION.search(said) else SlurmError
            raise error(f"salloc failed (exit status {process.returncode}): {' / '.join(lines)}")
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise SlurmError("salloc did not answer within its time: is slurmctld up?")
        time.sleep(LOOK_EVERY_S)
