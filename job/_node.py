"""The host agent of each node of a SLURM job, and what it asks SLURM at a notice.

`agent_command` is the ``meshvisor agent`` command line that the batch process (`job._batch`)
runs with srun on a node: listening at the address other hosts reach that node at (the job's
``listen_host``, else the node's ``NodeAddr`` as SLURM knows it, else what its host name
resolves to) with the job's CURVE keys, writing its address to ``agents/NODE.RESTART`` in the
job directory. The agent turns the job's warning signal into "preempting" events, asking
``python -m job._node --time-left JOB`` how much time is left.
"""

from __future__ import annotations

import os
import socket
import sys

from job._formats import SlurmFormatError, parse_duration
from job._jobdir import JobDir
from job._scheduler import SlurmError, node_record, run_slurm


def node_address(node: str) -> str:
    """Where other hosts reach `node`: its NodeAddr in SLURM, else its resolved host name."""
    record = node_record(node) or {}
    address = record.get("NodeAddr", "")
    if address and address != node:
        return address
    try:
        return socket.gethostbyname(address or socket.gethostname())
    except OSError:
        return "127.0.0.1"


def agent_command(
    job_dir: JobDir,
    node: str,
    restart: int,
    *,
    job_id: str | None = None,
    listen: str | None = None,
) -> list[str]:
    """The ``meshvisor agent`` command line for `node` in run `restart` of job `job_id` (the
    job this runs in when None), listening at `listen` (when None: any port of the node's
    address; an agent started again gives the address it had)."""
    spec = job_dir.read_spec()
    if listen is None:
        host = spec.listen_host or node_address(node)
        listen = f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"
    return [
        spec.python,
        "-m",
        "meshvisor",
        "agent",
        "--listen",
        listen,
        "--keys",
        spec.keys,
        "--address-file",
        str(job_dir.agent_file(node, restart)),
        *_notice_options(spec.python, spec.notice_signal, job_id or os.environ.get("SLURM_JOB_ID")),
    ]


def _notice_options(python: str, signal: str | None, job_id: str | None) -> list[str]:
    """The agent's options for the job's warning signal (none without one)."""
    if not signal or not job_id:
        return []
    ask = f"{python} -m job._node --time-left {job_id}"
    return ["--notice-signal", signal, "--time-left-command", ask]


def time_left(job_id: str) -> float | None:
    """Seconds until SLURM ends job `job_id` (its time limit, or a preemption's grace time),
    None when unknown (no limit, job gone)."""
    try:
        return parse_duration(run_slurm(["squeue", "-h", "-j", job_id, "-o", "%L"]))
    except (SlurmError, SlurmFormatError):
        return None


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--time-left":  # the agent asks, at a notice
        seconds = time_left(args[1])
        if seconds is None:
            sys.exit(1)
        print(seconds)
        return
    sys.exit("usage: python -m job._node --time-left JOB (asked by a SLURM job's agents)")


if __name__ == "__main__":
    main()
