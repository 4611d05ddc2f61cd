"""`SlurmAllocation`: the allocation of a chaos run on SLURM, one node per host.

A `SlurmJob` of one node more than the run has hosts: its first node holds the job's batch
script (losing that node ends the job, so no fault is aimed at it) and each other node is a host,
running a host agent in a job step. A lost node comes back with its agent at the address it had
(`SlurmJob.restart_agent`), so the workload's host meshes stay valid. On a `LocalSlurmCluster`
a lost node is a lost machine: its slurmd and every process of it are killed, and slurmd is
started again before SLURM's SlurmdTimeout would set the node DOWN. On another SLURM a user can
only lose the node's share of the job: its agent's step is killed (SIGKILL). The preemption
notice is the job's warning signal, sent by ``scancel --signal``. The job is cancelled when the
run ends, and by SLURM's reaper if the harness dies.

Processes (`procs`, `leftover_sockets`) are found in ``/proc``: on a cluster of many machines
only those of the nodes that are this machine are seen.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from job import SlurmError, SlurmJob
from job.testing import LocalSlurmCluster, agent_step

from ._allocation import children, procs_of
from ._errors import ChaosSetupError

#: The job's warning signal: SLURM's notice ahead of a preemption or of the time limit.
NOTICE_SIGNAL = "USR1"
#: How long a node's slurmd gets to take a job step again after it was started again.
NODE_BACK_TIMEOUT_S = 8.0
#: How long a job step gets to end after the job was cancelled.
STEP_END_TIMEOUT_S = 15.0


class SlurmAllocation:
    """A SLURM job whose nodes (all but the first) are a chaos run's hosts."""

    on_slurm = True

    def __init__(
        self,
        hosts: int,
        *,
        cluster: LocalSlurmCluster | None = None,
        partition: str | None = None,
        slurm_args: Sequence[str] = (),
        start_timeout_s: float = 120.0,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if hosts < 1:
            raise ValueError(f"a chaos allocation needs at least one host, not {hosts}")
        self.hosts = hosts
        self._cluster = cluster
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        self.directory = Path(tempfile.mkdtemp(prefix="meshvisor-chaos-", dir=base))
        self._job = SlurmJob(
            {"batch": 1, "hosts": hosts},
            name="meshvisor-chaos",
            partition=partition,
            slurm_args=slurm_args,
            warning_signal=NOTICE_SIGNAL,
            start_timeout_s=start_timeout_s,
            progress=progress,
            # The job's directory must be seen by every node: a private one on this machine
            # only for a cluster that is this machine.
            job_dir=self.directory if cluster is not None else None,
        )
        self.addresses: list[str] = []
        self.nodes: tuple[str, ...] = ()
        self._restarted: list[subprocess.Popen[bytes]] = []

    @property
    def job_id(self) -> str | None:
        """SLURM's id of the job, once submitted."""
        return self._job.job_id

    def __enter__(self) -> SlurmAllocation:
        try:
            state = self._job.state()
        except (SlurmError, TimeoutError) as exc:
            self.close()
            raise ChaosSetupError(f"the chaos run's SLURM job did not start: {exc}") from exc
        except BaseException:
            self.close()
            raise
        self.nodes = state.nodes["hosts"]
        self.addresses = [state.addresses[node] for node in self.nodes]
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- faults ---------------------------------------------------------------------------------

    def kill(self, host: int) -> None:
        """SIGKILL the agent's job step of `host`: the agent and its procs die."""
        _scancel("--signal=KILL", agent_step(self._require_job(), self._node(host)))

    def start(self, host: int) -> None:
        """Start the agent of `host` again, in a new job step at its address."""
        deadline = time.monotonic() + NODE_BACK_TIMEOUT_S
        while True:
            try:
                self._restarted.append(self._job.restart_agent(self._node(host)))
                return
            except SlurmError as exc:
                # A slurmd started again takes steps once it has registered, which nothing
                # tells from outside: its first refusals are expected, later ones are not.
                if time.monotonic() > deadline:
                    raise ChaosSetupError(f"host {host} did not come back: {exc}") from exc
                time.sleep(0.2)

    def kill_node(self, host: int) -> None:
        """Lose the node of `host`: the machine (a local cluster), else its agent's step."""
        if self._cluster is None:
            self.kill(host)
        else:
            self._cluster.kill_node(self._node(host))

    def restore_node(self, host: int) -> None:
        """Bring the node of `host` back (its slurmd, on a local cluster) and its agent."""
        if self._cluster is not None:
            self._cluster.restart_slurmd(self._node(host))
        self.start(host)

    def preempt(self) -> None:
        """Send the job's warning signal to every step, as SLURM does ahead of a preemption."""
        _scancel(f"--signal={NOTICE_SIGNAL}", self._require_job())

    # -- what is left -----------------------------------------------------------------------------

    def procs(self) -> set[int]:
        """Every proc the job's agents on this machine run (fork servers excluded)."""
        below: set[int] = set()
        for agent in self._agents():
            for forkserver in children(agent):
                below |= procs_of(forkserver)
        return below

    def leftover_sockets(self) -> list[Path]:
        """Socket files in the run directories of the job's agents on this machine."""
        found: list[Path] = []
        for agent in self._agents():
            for rundir in _run_dirs_of(agent):
                found += [path for path in rundir.iterdir() if path.is_socket()]
        return sorted(found)

    def close(self) -> None:
        """Cancel the job (its agents stop their procs) and remove its directory and the
        run's (nobody attaches to a chaos run's job afterwards)."""
        try:
            self._job.cancel()
        finally:
            if self._job.directory is not None:
                shutil.rmtree(self._job.directory, ignore_errors=True)
            for step in self._restarted:
                try:
                    step.wait(STEP_END_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    step.kill()
                    step.wait()
            shutil.rmtree(self.directory, ignore_errors=True)

    # -- internals --------------------------------------------------------------------------------

    def _node(self, host: int) -> str:
        if not 0 <= host < len(self.nodes):
            raise ChaosSetupError(f"the run has no host {host} (hosts 0-{len(self.nodes) - 1})")
        return self.nodes[host]

    def _require_job(self) -> str:
        if self._job.job_id is None:
            raise ChaosSetupError("the chaos run's SLURM job was not submitted")
        return self._job.job_id

    def _agents(self) -> list[int]:
        """The host agents of the job running on this machine (started by a slurmstepd)."""
        job = f"SLURM_JOB_ID={self._job.job_id}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                command = (entry / "cmdline").read_bytes()
                environ = (entry / "environ").read_bytes().split(b"\0")
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                above = Path(f"/proc/{parent}/cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            if b"meshvisor\0agent" in command and job in environ and above.startswith(b"slurm"):
                found.append(int(entry.name))
        return found


def _scancel(*arguments: str) -> None:
    """``scancel ARGUMENTS``; ChaosSetupError quoting SLURM if it fails."""
    done = subprocess.run(["scancel", *arguments], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ChaosSetupError(f"scancel {' '.join(arguments)} failed: {done.stderr.strip()}")


def _run_dirs_of(agent: int) -> list[Path]:
    """The run directories (``meshvisor-agent-*``) that host agent `agent` owns."""
    try:
        environ = Path(f"/proc/{agent}/environ").read_bytes().split(b"\0")
    except OSError:
        return []
    names = (b"XDG_RUNTIME_DIR=", b"TMPDIR=")
    bases = {item.split(b"=", 1)[1].decode() for item in environ if item.startswith(names)}
    bases.add(tempfile.gettempdir())
    found = []
    for base in bases:
        for rundir in Path(base).glob("meshvisor-agent-*"):
            try:
                if (rundir / "owner.pid").read_text().strip() == str(agent):
                    found.append(rundir)
            except OSError:
                continue
    return found
