"""A private SLURM cluster on this one machine, for tests, benchmarks and trying things out.

`LocalSlurmCluster` starts ``munged``, ``slurmctld`` and one ``slurmd -N nK`` per node with a
configuration, state directories, a munge key and ports of its own (Debian's SLURM runs several
nodes on one host with ``NodeHostname=localhost`` and one port per node). Nothing of the
machine's own SLURM set-up is read or touched: the cluster is used by processes that get its
`env` (``SLURM_CONF``). `stop` cancels every job, stops the daemons, kills what the jobs left
and removes the directory. Batch jobs start at slurmctld's next scheduling pass, within a
second of their submission (``batch_sched_delay=0``; SLURM's default lets a batch job wait up
to 3 s more, which would only add noise to tests and benchmarks).

SLURM itself comes from the distribution: on Debian, ``apt-get install slurmctld slurmd
slurm-client munge`` (``tests/install-system-packages`` does it where it is missing).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from job import _local_processes as _processes
from job._formats import parse_node_state as _parse_node_state
from job._local_processes import SlurmNotInstalled

__all__ = ("LocalSlurmCluster", "SlurmNotInstalled", "agent_step", "local_slurm_cluster")

#: The programs a local cluster needs, all from the distribution's SLURM and munge packages.
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel")


class LocalSlurmCluster:
    """munged, slurmctld and `nodes` slurmd daemons (nodes n1..nN, partition `partition`)."""

    def __init__(self, nodes: int = 4, *, cpus_per_node: int = 2, partition: str = "debug") -> None:
        missing = [p for p in PROGRAMS if shutil.which(p) is None and not _processes.in_sbin(p)]
        if missing:
            raise SlurmNotInstalled(
                f"cannot start a local SLURM cluster: {', '.join(missing)} not found; on Debian "
                "run tests/install-system-packages (apt-get install slurmctld slurmd "
                "slurm-client munge)"
            )
        if nodes < 1:
            raise ValueError(f"a cluster needs at least one node, not {nodes}")
        self.node_names = tuple(f"n{k}" for k in range(1, nodes + 1))
        self.partition = partition
        self.cpus_per_node = cpus_per_node
        self.directory = Path(tempfile.mkdtemp(prefix="mvslurm-"))
        os.chmod(self.directory, 0o700)
        self.conf = self.directory / "slurm.conf"
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def env(self) -> dict[str, str]:
        """The environment variables that make SLURM's commands use this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def environ(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """A copy of this process's environment pointed at this cluster (plus `extra`)."""
        return {**os.environ, **self.env, **(extra or {})}

    def start(self, timeout_s: float = 60.0) -> LocalSlurmCluster:
        """Start the daemons and wait until every node is idle (bounded by `timeout_s`)."""
        try:
            self._write_config()
            self._start_munge()
            self._start("slurmctld", ["slurmctld", "-D", "-i"])
            for node in self.node_names:
                self._start(f"slurmd-{node}", ["slurmd", "-D", "-N", node])
            self.wait_for_nodes("idle", self.node_names, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    # -- controlling nodes (for node-loss tests) ------------------------------------------------

    def kill_slurmd(self, node: str) -> None:
        """SIGKILL the slurmd of `node` (its job steps keep running, as on a real node whose
        daemon crashed)."""
        daemon = self._daemons.get(f"slurmd-{node}")
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
            daemon.wait()

    def restart_slurmd(self, node: str) -> None:
        """Start the slurmd of `node` again (after `kill_slurmd`)."""
        self.kill_slurmd(node)
        self._start(f"slurmd-{node}", ["slurmd", "-D", "-N", node])

    def kill_node(self, node: str) -> list[int]:
        """What a lost machine looks like: SIGKILL the slurmd of `node` and every process that
        runs for that node (its job steps' slurmstepd and their tasks: host agent, fork server,
        procs). Returns the pids killed besides slurmd."""
        self.kill_slurmd(node)
        killed: list[int] = []
        bases = {tempfile.gettempdir()}
        for _ in range(3):  # a task may fork while we look: look again until none is left
            pids = self._node_processes(node)
            bases |= {base for pid in pids for base in _processes.temp_bases(pid)}
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed += [pid for pid in pids if pid not in killed]
            if not pids:
                break
            time.sleep(0.05)
        _processes.remove_run_dirs_of(killed, bases)  # the node's local files go with it
        return killed

    def set_node_down(self, node: str, reason: str = "meshvisor test") -> None:
        """Set `node` DOWN in slurmctld (``scontrol update state=down``), as an admin or a
        health check does; `restore` resumes it."""
        self.run(["scontrol", "update", f"nodename={node}", "state=down", f"reason={reason}"])

    def kill_job_step(self, job_id: int | str, node: str) -> str:
        """``scancel`` the job step running the host agent of `node` (named
        ``meshvisor-agent-NODE``) of job `job_id`; returns its id ``JOB.STEP``."""
        step = agent_step(job_id, node, self.environ())
        self.run(["scancel", step])
        return step

    def _node_processes(self, node: str) -> list[int]:
        """The processes running for `node` of this cluster: those whose environment has
        ``SLURMD_NODENAME=node`` and this cluster's ``SLURM_CONF``, and the slurmstepd above
        them (the step daemons, whose environment does not name the node)."""
        wanted = {f"SLURMD_NODENAME={node}".encode(), f"SLURM_CONF={self.conf}".encode()}
        found: set[int] = set()
        for pid in _processes.all_pids():
            environ = _processes.read_proc(pid, "environ")
            if environ is not None and wanted <= set(environ.split(b"\0")):
                found.add(pid)
        for pid in list(found):
            parent = _processes.parent_of(pid)
            while parent > 1 and parent not in found:
                if (_processes.read_proc(parent, "cmdline") or b"").startswith(b"slurmstepd"):
                    found.add(parent)
                    break
                parent = _processes.parent_of(parent)
        found.discard(os.getpid())
        return sorted(found)

    def node_states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` prints it (lower case, e.g. ``idle``, ``down*``)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout
        states = {}
        for line in out.splitlines():
            name, _, state = line.strip().partition(" ")
            if name:
                states[name] = state.strip()
        return states

    def wait_for_nodes(self, state: str, nodes: tuple[str, ...], timeout_s: float) -> None:
        """Wait until every node of `nodes` is in `state` (as sinfo prints it, without flags)."""
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                states = self.node_states()
                if all(states.get(n, "").rstrip("*~#!%$@^-") == state for n in nodes):
                    return
            for name, daemon in self._daemons.items():
                if daemon.poll() is not None:
                    raise RuntimeError(
                        f"the local SLURM cluster's {name} exited with status "
                        f"{daemon.returncode}; see {self.directory / 'log'}"
                    )
            time.sleep(0.2)
        raise TimeoutError(
            f"the local SLURM cluster's nodes {list(nodes)} were not {state} within "
            f"{timeout_s:g} s (they are {states}); see {self.directory / 'log'}"
        )

    def run(
        self, command: list[str], timeout_s: float = 30.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a SLURM command against this cluster."""
        return subprocess.run(
            command,
            env=self.environ(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=check,
        )

    def cancel_all_jobs(self, timeout_s: float = 30.0) -> None:
        """Cancel every job of this user on the cluster and wait until none is left."""
        self.run(["scancel", "--user", getpass.getuser()], check=False)
        self._wait_for_no_jobs(timeout_s)

    def restore(self, timeout_s: float = 60.0) -> None:
        """Back to a fresh cluster: no job, every slurmd running (those killed by `kill_slurmd`
        or `kill_node` are started again), every node idle (nodes set down or drained by a
        test, or by slurmctld after losing them, are resumed)."""
        self.cancel_all_jobs(timeout_s / 2)
        for node in self.node_names:
            daemon = self._daemons.get(f"slurmd-{node}")
            if daemon is None or daemon.poll() is not None:
                self.restart_slurmd(node)
        for node, state in self.node_states().items():
            if _parse_node_state(state).base == "DOWN" or "DRAIN" in _parse_node_state(state).flags:
                self.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        self.wait_for_nodes("idle", self.node_names, timeout_s)

    # -- teardown --------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill whatever the jobs left, remove the files."""
        if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                self.cancel_all_jobs(10.0)
        for name in sorted(self._daemons, key=lambda n: n == "munged"):  # munged last
            daemon = self._daemons[name]
            if daemon.poll() is None:
                daemon.terminate()
        for daemon in self._daemons.values():
            try:
                daemon.wait(timeout=5)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self._daemons.clear()
        _processes.kill_processes_with_env("SLURM_CONF", str(self.conf))
        shutil.rmtree(self.directory, ignore_errors=True)

    def _wait_for_no_jobs(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.run(["squeue", "-h", "-o", "%i"], timeout_s=5).stdout.strip():
                return
            time.sleep(0.2)

    def __enter__(self) -> LocalSlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<LocalSlurmCluster {len(self.node_names)} nodes in {self.directory}>"

    # -- set-up ----------------------------------------------------------------------------------

    def _write_config(self) -> None:
        d = self.directory
        for sub in ("state", "spool", "run", "log", "munge"):
            (d / sub).mkdir(mode=0o700)
        user = getpass.getuser()
        ctld, slurmd, *node_ports = _processes.free_ports(2 + len(self.node_names))
        nodes = "\n".join(
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={self.cpus_per_node} RealMemory=2000 State=UNKNOWN"
            for name, port in zip(self.node_names, node_ports, strict=True)
        )
        self.conf.write_text(
            f"""\
ClusterName=meshvisor
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.sock
CredType=cred/munge
SlurmUser={user}
SlurmdUser={user}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
SlurmdTimeout=10
MessageTimeout=5
KillWait=2
MinJobAge=30
{nodes}
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""
        )

    def _start_munge(self) -> None:
        munge = self.directory / "munge"
        key = munge / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as handle:
            handle.write(os.urandom(1024))
        self._start(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={munge / 'munge.sock'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
        )
        deadline = time.monotonic() + 10
        while not (munge / "munge.sock").exists():
            if time.monotonic() > deadline or self._daemons["munged"].poll() is not None:
                raise RuntimeError(f"munged did not start; see {munge / 'munged.log'}")
            time.sleep(0.05)

    def _start(self, name: str, command: list[str]) -> None:
        with open(self.directory / "log" / f"{name}.out", "wb") as log:
            self._daemons[name] = subprocess.Popen(
                [_processes.program(command[0]), *command[1:]],
                env=self.environ(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )


def agent_step(job_id: int | str, node: str, env: Mapping[str, str] | None = None) -> str:
    """The id ``JOB.STEP`` of the newest step of job `job_id` running the host agent of
    `node` (named ``meshvisor-agent-NODE``), asking the SLURM of `env` (default: this
    process's); LookupError naming the job's steps if none runs."""
    out = subprocess.run(
        ["squeue", "-h", "-s", "-j", str(job_id), "-o", "%i %j"],
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    found = []
    for line in out.splitlines():
        step, _, name = line.strip().partition(" ")
        if name.strip() == f"meshvisor-agent-{node}":
            found.append(step)
    if not found:
        raise LookupError(f"job {job_id} has no step meshvisor-agent-{node}; its steps:\n{out}")
    return max(found, key=lambda step: int(step.rpartition(".")[2]))


@contextlib.contextmanager
def local_slurm_cluster(nodes: int = 4) -> Iterator[LocalSlurmCluster]:
    """A started `LocalSlurmCluster`, stopped (everything removed) when the block ends."""
    cluster = LocalSlurmCluster(nodes)
    with cluster:
        yield cluster
