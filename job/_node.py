"""What runs on each node of a SLURM job: ``python -m job._node JOBDIR`` (started by srun).

It finds the address other hosts reach this node at (the job's ``listen_host``, else the node's
``NodeAddr`` as SLURM knows it, else what its host name resolves to) and becomes a
``meshvisor agent`` listening there with the job's CURVE keys, writing its address to
``agents/NODE.RESTART`` in the job directory. Procs are told their node's name
(``MESHVISOR_HOST_NAME``), so supervision events name the node. The agent turns the job's
warning signal into "preempting" events, asking ``python -m job._node --time-left JOB`` how
much time is left.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from job._formats import SlurmFormatError, parse_duration
from job._jobdir import JobDir
from job._scheduler import SlurmError, node_record, run_slurm


def node_name() -> str:
    """This node's name in SLURM (several nodes may share one machine, so not its host name)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


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


def agent_command(job_dir: JobDir) -> list[str]:
    """The ``meshvisor agent`` command line for this node."""
    spec = job_dir.read_spec()
    node = node_name()
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
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
        *_notice_options(spec.python, spec.notice_signal),
    ]


def _notice_options(python: str, signal: str | None) -> list[str]:
    """The agent's options for the job's warning signal (none without one)."""
    job_id = os.environ.get("SLURM_JOB_ID")
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
    if len(args) != 1:
        sys.exit("usage: python -m job._node JOBDIR (run by a meshvisor SLURM job on each node)")
    job_dir = JobDir(Path(args[0]))
    command = agent_command(job_dir)
    os.environ["MESHVISOR_HOST_NAME"] = node_name()
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
