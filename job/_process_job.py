"""`ProcessJob`: a job whose hosts are host agents started as local processes (development).

Each host of each named mesh is one ``meshvisor agent`` daemon on this machine, listening on an
ipc socket in a private directory of its own, so that multi-host code runs unchanged on one
machine (``monarch.job.ProcessJob``'s role). The agents belong to the client that applied the
job: they stop with ``kill()``, and on their own when that client exits or dies
(``--parent-pid``), removing their directories, so a crashed notebook or test leaves nothing
behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from job._job import JobTrait, check_meshes
from job._job_state import JobState
from mesh import attach

#: How long a stopped agent gets to end by itself before it is killed.
STOP_GRACE_S = 10.0


class ProcessJob(JobTrait):
    """Named host meshes of local host agents: ``ProcessJob({"trainers": 2}).state().trainers``
    is a `HostMesh` of 2 hosts, each its own agent process on this machine."""

    def __init__(
        self,
        meshes: Mapping[str, int],
        env: Mapping[str, str] | None = None,
        *,
        agent_args: Sequence[str] = (),
        start_timeout_s: float = 30.0,
    ) -> None:
        """`env` adds to the agents' environment (their procs inherit it); `agent_args` are
        more ``meshvisor agent`` options for every agent (e.g. ``["--preload", "torch"]``)."""
        check_meshes(meshes)
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be positive, not {start_timeout_s}")
        self.meshes = dict(meshes)
        self.start_timeout_s = start_timeout_s
        self._env = dict(env or {})
        self._agent_args = list(agent_args)
        self._homes: dict[str, Path] = {}
        self._agents: dict[str, subprocess.Popen[bytes]] = {}
        self._state: JobState | None = None

    @property
    def hosts(self) -> dict[str, tuple[str, ...]]:
        """The host keys of each mesh, e.g. ``{"trainers": ("trainers_0", "trainers_1")}``."""
        return {
            name: tuple(f"{name}_{i}" for i in range(count)) for name, count in self.meshes.items()
        }

    @property
    def agent_pids(self) -> dict[str, int]:
        """The pid of each host's agent, by host key, while the job runs."""
        return {host: agent.pid for host, agent in self._agents.items()}

    def apply(self) -> ProcessJob:
        """Start one host agent per host (once; later calls do nothing)."""
        if self._agents:
            return self
        try:
            for keys in self.hosts.values():
                for host in keys:
                    self._start(host)
        except BaseException:
            self.kill()
            raise
        return self

    def state(
        self, timeout_s: float | None = None, *, cached_path: str | os.PathLike[str] | None = None
    ) -> JobState:
        """The host meshes by name once every agent answers (bounded by `timeout_s`, default
        `start_timeout_s`): RuntimeError quoting an agent that exited, TimeoutError naming the
        hosts that did not come up. There is no `cached_path`: the agents end with the client."""
        if cached_path is not None:
            raise ValueError(
                "a ProcessJob cannot be cached for a later run: its agents stop with this "
                "client; use a persistent allocation ('meshvisor agent --allocation NAME', "
                "then mesh.attach(NAME)) or SlurmJob(..., persistent=True)"
            )
        self.apply()
        if self._state is not None:
            return self._state
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        addresses = {host: self._wait_for_address(host, deadline) for host in self._agents}
        meshes = {
            name: attach([addresses[host] for host in keys]) for name, keys in self.hosts.items()
        }
        for host_mesh in meshes.values():
            host_mesh.wait_for_agents(max(1.0, deadline - time.monotonic()))
        self._state = JobState(f"process-{os.getpid()}", meshes, self.hosts, 0, addresses)
        return self._state

    def kill(self) -> None:
        """Stop every agent (and the procs on them) and remove their directories."""
        if self._state is not None:
            for host_mesh in self._state.meshes.values():
                host_mesh.shutdown()  # this client knows they stop on purpose
            self._state = None
        for agent in self._agents.values():
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        for agent in self._agents.values():
            try:
                agent.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        self._agents.clear()
        for home in self._homes.values():
            shutil.rmtree(home, ignore_errors=True)
        self._homes.clear()

    def __repr__(self) -> str:
        running = "running" if self._agents else "not running"
        return f"<ProcessJob meshes={self.meshes} {running}>"

    def _start(self, host: str) -> None:
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        home = self._homes[host] = Path(tempfile.mkdtemp(prefix=f"meshvisor-{host}-", dir=base))
        with open(home / "agent.log", "wb") as log:
            self._agents[host] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "mesh._agent",
                    *("--listen", f"ipc://{home}/agent", "--rundir", str(home)),
                    *("--address-file", str(home / "address")),
                    *("--parent-pid", str(os.getpid()), "--remove-rundir"),
                    *self._agent_args,
                ],
                env={**os.environ, "MESHVISOR_HOST_NAME": host, **self._env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def _wait_for_address(self, host: str, deadline: float) -> str:
        home, agent = self._homes[host], self._agents[host]
        ready = home / "address"
        while not ready.exists():
            if agent.poll() is not None:
                output = (home / "agent.log").read_text(errors="replace")
                raise RuntimeError(
                    f"the host agent of {host} exited with status {agent.returncode} before it "
                    f"listened; its output:\n{output.strip()[-2000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the host agent of {host} did not start in time")
            time.sleep(0.01)
        return ready.read_text().strip()
