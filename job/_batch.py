"""The batch process of a SLURM job: ``python -m job._batch JOBDIR``, run by sbatch on the
job's first node, or by salloc beside the client for a job that ends with it (`job._salloc`).

It starts one job step per node (``srun`` on that node alone), each running a host agent
(`job._node.agent_command`), so that losing one node's step leaves the others running. Without
a client script it waits while any agent runs (``scancel`` ends the job); in batch mode it runs the
client script here, on the first node, and the job ends when the script does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from job._formats import expand_hostlist
from job._jobdir import JobDir, JobSpec
from job._node import agent_command, node_addresses
from job._scheduler import SlurmError, cancel, job_nodes, job_record

#: How long the agents get to stop (and stop their procs) after a batch-mode client ended.
STOP_TIMEOUT_S = 15.0
#: How long the step sweeping a node after its agent's step ended may take (its node may be
#: lost: srun then waits for SLURM to give up on it).
SWEEP_TIMEOUT_S = 30.0


def start_agent_steps(job_dir: JobDir, nodelist: str) -> list[subprocess.Popen[bytes]]:
    """One job step per node of the host list `nodelist`, each running its host agent. The
    steps start together; SLURM is asked once for every node's address."""
    spec = job_dir.read_spec()
    nodes = expand_hostlist(nodelist)
    addresses = node_addresses(nodes, nodelist)
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    return [
        start_agent_step(spec, job_dir, node, restart, node_addr=addresses[node]) for node in nodes
    ]


def start_agent_step(
    spec: JobSpec,
    job_dir: JobDir,
    node: str,
    restart: int,
    *,
    node_addr: str | None = None,
    job_id: str | None = None,
    listen: str | None = None,
    output: IO[bytes] | None = None,
) -> subprocess.Popen[bytes]:
    """One job step on `node` running its host agent, told its node's name (so that events
    name the node: several nodes may share one machine). Inside the job by default; from
    outside it, in job `job_id`, listening at `listen` (see `agent_command`), writing to
    `output` (default: this process's output)."""
    return subprocess.Popen(
        [
            "srun",
            *([f"--jobid={job_id}"] if job_id else []),
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={node}",
            "--overlap",
            "--kill-on-bad-exit=0",
            f"--job-name=meshvisor-agent-{node}",
            f"--export=ALL,MESHVISOR_HOST_NAME={node}",
            *agent_command(
                spec, job_dir, node, restart, node_addr=node_addr, job_id=job_id, listen=listen
            ),
        ],
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=output,
    )


def restart_agent_step(
    job_dir: JobDir, job_id: str, node: str, timeout_s: float
) -> subprocess.Popen[bytes]:
    """Start the host agent of `node` again (from outside job `job_id`, as a node manager
    brings a lost node's daemon back) in a new step, at the address its agent of this run
    had, so that host meshes holding that address stay valid; returns once it listens."""
    record = job_record(job_id)
    if record is None or record.get("JobState") != "RUNNING":
        raise SlurmError(f"cannot restart an agent of SLURM job {job_id}: it does not run")
    if node not in job_nodes(record):
        raise ValueError(f"SLURM job {job_id} holds no node {node!r}: {job_nodes(record)}")
    restart = int(record.get("Restarts", "0") or 0)
    address = job_dir.agent_addresses([node], restart).get(node)
    if address is None:
        raise SlurmError(f"the agent of {node} in SLURM job {job_id} never started")
    written = job_dir.agent_file(node, restart)
    before = written.stat().st_ino
    with open(job_dir.output_file(job_id), "ab") as output:  # with the other steps' output
        step = start_agent_step(
            job_dir.read_spec(),
            job_dir,
            node,
            restart,
            job_id=job_id,
            listen=address,
            output=output,
        )
    deadline = time.monotonic() + timeout_s
    while not written.exists() or written.stat().st_ino == before:  # rewritten once it listens
        if step.poll() is not None or time.monotonic() > deadline:
            step.kill()
            step.wait()
            raise SlurmError(
                f"the agent of {node} in SLURM job {job_id} did not start again at {address} "
                f"within {timeout_s:g} s (srun exit status {step.returncode})"
            )
        time.sleep(0.02)
    return step


class StepSweeper:
    """Cleans up after agent steps that end while the job runs: an agent killed by SIGKILL
    (its step cancelled, KillWait over) leaves its run directory on its node, where only a
    process on that node can remove it; a short step there removes the run directories whose
    owner is dead (``python -m job._node --sweep-run-dirs``)."""

    def __init__(self, python: str, steps: dict[str, subprocess.Popen[bytes]]) -> None:
        self._python, self._steps = python, dict(steps)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-sweeper", daemon=True)

    def start(self) -> StepSweeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Sweep no more (the job ends: its steps end on purpose)."""
        self._stopped.set()

    def _watch(self) -> None:
        while self._steps and not self._stopped.wait(0.5):
            for node, step in list(self._steps.items()):
                if step.poll() is not None and not self._stopped.is_set():
                    del self._steps[node]
                    self._sweep(node)

    def _sweep(self, node: str) -> None:
        command = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap"]
        command += [f"--job-name=meshvisor-sweep-{node}", self._python, "-m", "job._node"]
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run(
                [*command, "--sweep-run-dirs"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=SWEEP_TIMEOUT_S,
                check=False,
            )


def run_client(script: list[str], job_dir: JobDir) -> int:
    """Run the batch-mode client script; its exit status."""
    env = {**os.environ, "MESHVISOR_SLURM_JOB_DIR": str(job_dir.path)}
    client = subprocess.Popen(script, env=env, stdin=subprocess.DEVNULL)
    signal.signal(signal.SIGTERM, lambda *_: client.terminate())
    status = client.wait()
    return status if status >= 0 else 128 - status  # killed by a signal: as a shell says it


def stop_steps(steps: list[subprocess.Popen[bytes]], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Ask every agent to stop (SIGTERM to the job's steps, not to srun, which would kill
    them) and wait, bounded, until they have cleaned up: when the batch script ends, SLURM
    kills what is left after only its KillWait."""
    with contextlib.suppress(SlurmError):
        cancel(os.environ["SLURM_JOB_ID"], signal="TERM")
    deadline = time.monotonic() + timeout_s
    for step in steps:
        try:
            step.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            step.kill()
            step.wait()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m job._batch JOBDIR (run by sbatch for a meshvisor SLURM job)")
    job_dir = JobDir(Path(args[0]))
    spec = job_dir.read_spec()
    nodelist = os.environ["SLURM_JOB_NODELIST"]
    steps = start_agent_steps(job_dir, nodelist)
    sweeper = StepSweeper(spec.python, dict(zip(expand_hostlist(nodelist), steps, strict=True)))
    sweeper.start()
    if spec.script:
        status = run_client(spec.script, job_dir)
        print(f"meshvisor: the client script ended with status {status}", flush=True)
        sweeper.stop()
        stop_steps(steps)
        return status
    while any(step.poll() is None for step in steps):
        time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
