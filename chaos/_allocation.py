"""The allocation a chaos run works on (`Allocation`), and `LocalAllocation`, the persistent
one built on this machine (`SlurmAllocation` is the one on SLURM).

One daemon host agent (``python -m mesh._agent``) per simulated host, each listening on an ipc
address in a private directory, so that a killed agent can be started again at the same
address, as a node manager would restart it. The workload's clients attach to these agents;
they outlive the clients, which is what lets a killed client be replaced.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Protocol

from mesh.testing import DEATH_WAITER_NAME

from ._errors import ChaosSetupError

AGENT_START_TIMEOUT_S = 30.0


class Allocation(Protocol):
    """Host agents a chaos run works on, and what the harness may do to them."""

    #: How many hosts; their agents' addresses, in host order.
    hosts: int
    addresses: list[str]
    #: A private directory for the run's files (the clients' logs).
    directory: Path
    #: Whether it is a SLURM job (node faults and the job's preemption are possible).
    on_slurm: bool

    def start(self, host: int) -> None:
        """Start the agent of `host` again, at its address."""
        ...

    def kill(self, host: int) -> object:
        """SIGKILL the agent of `host` (its procs die with it)."""
        ...

    def kill_node(self, host: int) -> None:
        """Lose the SLURM node of `host`."""
        ...

    def restore_node(self, host: int) -> None:
        """Bring the node of `host` back, with its agent at its address."""
        ...

    def preempt(self) -> None:
        """Send SLURM's preemption notice to the job."""
        ...

    def procs(self) -> set[int]:
        """Every proc the agents run (on this machine)."""
        ...

    def leftover_sockets(self) -> list[Path]:
        """Socket files left in the agents' run directories by procs that ended."""
        ...

    def close(self) -> None:
        """Stop everything and remove what the allocation made."""
        ...


class LocalAllocation:
    """Host agents started as daemons on this machine, one per simulated host."""

    on_slurm = False

    def __init__(
        self,
        hosts: int,
        *,
        owner_timeout_s: float = 3.0,
        preload: tuple[str, ...] = (),
        verbose: bool = False,
    ) -> None:
        if hosts < 1:
            raise ValueError(f"a chaos allocation needs at least one host, not {hosts}")
        self.hosts = hosts
        self.owner_timeout_s = owner_timeout_s
        self.preload = preload
        self._verbose = verbose
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        self.directory = Path(tempfile.mkdtemp(prefix="meshvisor-chaos-", dir=base))
        self.addresses = [f"ipc://{self.directory}/h{i}/agent" for i in range(hosts)]
        self._agents: list[subprocess.Popen[bytes] | None] = [None] * hosts

    def __enter__(self) -> LocalAllocation:
        try:
            for host in range(self.hosts):
                (self.directory / f"h{host}").mkdir(mode=0o700)
                self.start(host)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self, host: int) -> None:
        """Start (or start again) the agent of `host`, at its fixed address."""
        ready = self.directory / f"h{host}" / "address"
        ready.unlink(missing_ok=True)
        output = None if self._verbose else subprocess.DEVNULL
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mesh._agent",
                "--listen",
                self.addresses[host],
                "--rundir",
                str(self.directory / f"h{host}"),
                "--address-file",
                str(ready),
                "--owner-timeout",
                str(self.owner_timeout_s),
                "--parent-pid",  # a harness killed by SIGKILL leaves no agent behind
                str(os.getpid()),
                *(["--preload", ",".join(self.preload)] if self.preload else []),
            ],
            stdout=output,
            stderr=output,
        )
        self._agents[host] = agent
        deadline = time.monotonic() + AGENT_START_TIMEOUT_S
        while not ready.exists():
            if agent.poll() is not None:
                raise ChaosSetupError(f"the host agent of host {host} exited at start")
            if time.monotonic() > deadline:
                raise ChaosSetupError(f"the host agent of host {host} did not start in time")
            time.sleep(0.01)

    def pid(self, host: int) -> int:
        agent = self._agents[host]
        if agent is None:
            raise ChaosSetupError(f"host {host} has no agent running")
        return agent.pid

    def kill(self, host: int) -> int:
        """SIGKILL the agent of `host` (its procs die with it); returns its pid."""
        agent = self._agents[host]
        if agent is None:
            raise ChaosSetupError(f"host {host} has no agent running")
        agent.kill()
        agent.wait()
        return agent.pid

    def kill_node(self, host: int) -> None:
        raise self._not_on_slurm()

    def restore_node(self, host: int) -> None:
        raise self._not_on_slurm()

    def preempt(self) -> None:
        raise self._not_on_slurm()

    def _not_on_slurm(self) -> ChaosSetupError:
        return ChaosSetupError(
            "node faults and preemption need a run on SLURM (--slurm local or env); "
            "this run's hosts are agents on this machine"
        )

    def procs(self) -> set[int]:
        """Every process below the agents (fork servers excluded): the procs they run."""
        below: set[int] = set()
        for agent in self._agents:
            if agent is None or agent.poll() is not None:
                continue
            for forkserver in children(agent.pid):
                below |= procs_of(forkserver)
        return below

    def leftover_sockets(self) -> list[Path]:
        """Socket files in the agents' directories that belong to no agent."""
        own = {address[len("ipc://") :] for address in self.addresses}
        return sorted(
            path
            for path in self.directory.glob("h*/*")
            if path.is_socket() and str(path) not in own
        )

    def close(self) -> None:
        """Stop every agent (gracefully, then by force) and remove the directory."""
        for agent in self._agents:
            if agent is not None and agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        for agent in self._agents:
            if agent is None:
                continue
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def procs_of(forkserver: int) -> set[int]:
    """The procs a fork server runs: its children but its death waiter."""
    found = set()
    for pid in children(forkserver):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name != DEATH_WAITER_NAME:
            found.add(pid)
    return found


def children(pid: int) -> set[int]:
    """The child processes of `pid`."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.add(int(entry.name))
    return found
