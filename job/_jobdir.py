"""A SLURM job's directory: its spec, keys, agents' addresses and output, shared by every node.

``$MESHVISOR_HOME/slurm/NAME-TOKEN/`` (default ``~/.meshvisor``; it must be on a file system
that every node and the client see, as home directories are on clusters):

- ``job.json``: what was asked (`JobSpec`) and, once submitted, the job id;
- ``keys/``: the CURVE keys made for the job (private), unless the client brought its own;
- ``agents/NODE.RESTART``: the address of the agent on NODE, written by it when it listens
  (RESTART is SLURM's requeue count, so a requeued job's agents are told apart);
- ``batch.sh`` and ``slurm-JOBID.out``: the script sbatch runs and what it (or salloc) printed;
- ``logs/``: the per-rank log files of the procs on its agents (``meshvisor logs --job``).
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class JobSpec:
    """What a `SlurmJob` asked SLURM for, as saved in ``job.json``."""

    name: str
    meshes: dict[str, int]
    persistent: bool
    keys: str
    python: str
    listen_host: str | None = None
    script: list[str] = field(default_factory=list)  # batch mode: the client's command line
    job_id: str | None = None
    notice_signal: str | None = None  # SLURM's warning (--signal) that agents turn into events

    @property
    def nodes(self) -> int:
        return sum(self.meshes.values())


def jobs_home() -> Path:
    """Where job directories are kept (created private on first use)."""
    from mesh import current_settings  # here: the processes on the nodes never need `mesh`

    path = current_settings().allocations_home / "slurm"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


class JobDir:
    """The directory of one job (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, name: str, root: Path | None = None) -> JobDir:
        path = (root or jobs_home()) / f"{name}-{secrets.token_hex(4)}"
        path.mkdir(mode=0o700, parents=False)
        (path / "agents").mkdir(mode=0o700)
        return cls(path)

    @property
    def spec_file(self) -> Path:
        return self.path / "job.json"

    @property
    def agents_dir(self) -> Path:
        return self.path / "agents"

    @property
    def logs_dir(self) -> Path:
        """Where the job's agents keep their procs' log files."""
        return self.path / "logs"

    @property
    def batch_script(self) -> Path:
        return self.path / "batch.sh"

    def output_file(self, job_id: str | None = None) -> Path:
        return self.path / f"slurm-{job_id or '%j'}.out"

    def read_spec(self) -> JobSpec:
        try:
            data = json.loads(self.spec_file.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"{self.spec_file} is not a meshvisor job's spec: {error}") from None
        return JobSpec(**data)

    def write_spec(self, spec: JobSpec) -> None:
        """Replace ``job.json`` whole (readers see the old or the new one)."""
        temporary = self.path / f".job.json.tmp-{os.getpid()}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(asdict(spec), handle, indent=1)
        os.replace(temporary, self.spec_file)

    def agent_file(self, node: str, restart: int) -> Path:
        return self.agents_dir / f"{node}.{restart}"

    def agents_written(self, restart: int) -> int:
        """How many agents of run `restart` wrote their address so far (a directory read)."""
        try:
            names = os.listdir(self.agents_dir)
        except OSError:
            return 0
        return sum(1 for name in names if name.endswith(f".{restart}"))

    def agent_addresses(self, nodes: list[str], restart: int) -> dict[str, str]:
        """The addresses that the agents of this run (requeue count `restart`) wrote so far."""
        found = {}
        for node in nodes:
            try:
                address = self.agent_file(node, restart).read_text().strip()
            except OSError:
                continue
            if address:
                found[node] = address
        return found


def job_dirs_matching(job: str, root: Path | None = None) -> list[JobDir]:
    """The directories of the jobs with SLURM id or name `job`, newest first; LookupError
    naming the jobs there if there is none."""
    home = root or jobs_home()
    matches = []
    known = []
    for found in all_job_dirs(home):
        try:
            spec = found.read_spec()
        except (ValueError, TypeError):
            continue
        known.append(f"{spec.name} ({spec.job_id or 'not submitted'})")
        if job in (spec.job_id, spec.name):
            matches.append(found)
    if not matches:
        there = f"the jobs there are {', '.join(known)}" if known else "there is none"
        raise LookupError(
            f"no meshvisor SLURM job has the id or name {job!r} in {home} ({there}); "
            "'meshvisor slurm list' lists them (pass --job-dir or job_dir= for another place)"
        )
    return matches[::-1]


def all_job_dirs(root: Path | None = None) -> list[JobDir]:
    """Every job directory, oldest first."""
    home = root or jobs_home()
    found = []
    for spec_file in home.glob("*/job.json"):
        try:
            found.append((spec_file.stat().st_mtime, spec_file.parent))
        except OSError:  # removed meanwhile
            continue
    return [JobDir(path) for _, path in sorted(found)]
