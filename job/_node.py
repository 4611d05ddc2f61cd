"""The host agent of each node of a SLURM job, and what it asks SLURM at a notice.

`agent_command` is the ``meshvisor agent`` command line that the batch process (`job._batch`)
runs with srun on a node: listening at the address other hosts reach that node at (the job's
``listen_host``, else the node's ``NodeAddr`` as SLURM knows it, else what its host name
resolves to) with the job's CURVE keys, writing its address to ``agents/NODE.RESTART`` in the
job directory. The agent turns the job's warning signal into "preempting" events, asking
``python -m job._node --time-left JOB`` how much time is left. After an agent's step ended, the
batch process runs ``python -m job._node --sweep-run-dirs`` on its node (`sweep_run_dirs`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile

from job._formats import SlurmFormatError, parse_duration
from job._jobdir import JobDir, JobSpec
from job._scheduler import SlurmError, node_records, run_slurm
from mesh.tooling import sweep_stale_run_dirs


def node_addresses(nodes: list[str], nodelist: str) -> dict[str, str]:
    """Where other hosts reach each of `nodes` (the host list `nodelist`): its NodeAddr in
    SLURM, else its resolved host name; one question to SLURM for all of them."""
    records = node_records(nodelist)
    return {node: _address(records.get(node, {}).get("NodeAddr", ""), node) for node in nodes}


def _address(node_addr: str, node: str) -> str:
    if node_addr and node_addr != node:
        return node_addr
    try:
        return socket.gethostbyname(node_addr or socket.gethostname())
    except OSError:
        return "127.0.0.1"


def agent_command(
    spec: JobSpec,
    job_dir: JobDir,
    node: str,
    restart: int,
    *,
    node_addr: str | None = None,
    job_id: str | None = None,
    listen: str | None = None,
) -> list[str]:
    """The ``meshvisor agent`` command line for `node` in run `restart` of job `job_id` (the
    job this runs in when None), listening at `listen`; when None, at any port of the job's
    `listen_host`, else of `node_addr` (where other hosts reach the node). An agent started
    again gets the address it had."""
    if listen is None:
        host = spec.listen_host or node_addr
        if host is None:
            raise ValueError(f"agent_command() needs the address of node {node}")
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
        "--log-dir",
        str(job_dir.logs_dir),
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


def sweep_run_dirs() -> None:
    """Remove this node's meshvisor run directories whose owner died (an agent killed by
    SIGKILL had no time to), where agents make them: XDG_RUNTIME_DIR, the temp directory."""
    for base in {os.environ.get("XDG_RUNTIME_DIR") or "", tempfile.gettempdir()} - {""}:
        with contextlib.suppress(OSError):
            sweep_stale_run_dirs(base)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--sweep-run-dirs"]:  # the batch process, after an agent's step ended
        sweep_run_dirs()
        return
    if len(args) == 2 and args[0] == "--time-left":  # the agent asks, at a notice
        seconds = time_left(args[1])
        if seconds is None:
            sys.exit(1)
        print(seconds)
        return
    sys.exit(
        "usage: python -m job._node --time-left JOB | --sweep-run-dirs (run by a SLURM job's "
        "agents and batch process)"
    )


if __name__ == "__main__":
    main()
