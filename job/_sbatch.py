"""What a `SlurmJob` asks sbatch for: its options and its batch script, checked first."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from job._formats import format_duration


def sbatch_arguments(
    *,
    name: str,
    nodes: int,
    partition: str | None,
    time_limit: str | float | None,
    gpus_per_node: int | None,
    cpus_per_task: int | None,
    mem: str | None,
    account: str | None,
    qos: str | None,
    exclusive: bool,
    requeue: bool,
    warning: str | None,
    extra: Sequence[str],
) -> list[str]:
    """sbatch's options for the job: one task per node, no kill on a node's failure."""
    arguments = [
        f"--job-name={name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        "--no-kill",
        "--requeue" if requeue else "--no-requeue",
    ]
    optional = {
        "partition": partition,
        "time": format_duration(time_limit) if isinstance(time_limit, int | float) else time_limit,
        "gpus-per-node": gpus_per_node,
        "cpus-per-task": cpus_per_task,
        "mem": mem,
        "account": account,
        "qos": qos,
        "signal": warning,
    }
    arguments += [f"--{option}={value}" for option, value in optional.items() if value is not None]
    if exclusive:
        arguments.append("--exclusive")
    if isinstance(extra, str):
        raise TypeError("slurm_args must be a sequence of arguments, not one string")
    return [*arguments, *extra]


def batch_script(python: str, job_dir: Path) -> str:
    """The script sbatch runs: the job's batch process (`job._batch`) on the first node."""
    return f"#!/bin/sh\nexec {shlex.quote(python)} -m job._batch {shlex.quote(str(job_dir))}\n"
