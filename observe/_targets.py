"""Which host agents a viewer looks at: `Target`, found from what the user named.

- a running client on this machine (``--pid``, or every one when nothing is named): its local
  agent listens in the client's private run directory, ``meshvisor-*/agent-*``, beside the
  ``owner.pid`` file that names the client;
- a persistent allocation (``--allocation NAME|FILE``): the agents listed in its file, with the
  CURVE keys made for it;
- agents by address (``--agent ADDRESS``, repeatable), with ``MESHVISOR_CURVE_KEYS`` for tcp;
- a SLURM job (``--slurm-job ID|NAME``): the agents its nodes wrote in the job's directory,
  with the job's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.tooling import allocation_keys_dir, read_allocation
from observe._local_clients import local_clients
from transport import KEYS_ENV, runtime_base_dir, transport_settings

#: The run directory file that names the client owning it (`mesh._engine.run_dirs.OWNER_FILE`).


class TargetError(Exception):
    """What the user named cannot be looked at: no such client, allocation or job."""


@dataclass(frozen=True)
class Target:
    """Agents to query, what they are (for the title), and the keys for tcp ones."""

    title: str
    agents: tuple[str, ...]
    keys: str | None = None


def client_target(pid: int | None, base: str | None = None) -> Target:
    """The local agents of the running client `pid` (None: of every running client)."""
    base = base or runtime_base_dir()
    found = [(owner, agent) for owner, agent in local_clients(base) if pid in (None, owner)]
    if not found:
        which = f"client with pid {pid}" if pid is not None else "meshvisor client"
        raise TargetError(
            f"no running {which} with a local agent in {base}: start one (this_host() starts "
            "its agent), or name an allocation (--allocation), agents (--agent ADDRESS) or a "
            "SLURM job (--slurm-job ID)"
        )
    pids = ", ".join(str(owner) for owner, _ in found)
    title = f"client {pids}" if len(found) == 1 else f"clients {pids}"
    return Target(title, tuple(agent for _, agent in found))


def allocation_target(name_or_path: str) -> Target:
    """The agents of a persistent allocation, with the keys made for it if there are some."""
    try:
        agents = read_allocation(name_or_path)
    except ValueError as error:
        raise TargetError(str(error)) from None
    if not agents:
        raise TargetError(
            f"allocation {name_or_path!r} lists no agent: its agents stopped; start them with "
            f"'meshvisor agent --allocation {name_or_path}'"
        )
    own = allocation_keys_dir(name_or_path)
    keys = str(own) if (own / "allocation.key_secret").exists() else None
    return Target(f"allocation {name_or_path}", tuple(agents), keys)


def agents_target(addresses: list[str]) -> Target:
    """Agents named by address; tcp ones need ``MESHVISOR_CURVE_KEYS``."""
    for address in addresses:
        if not address.startswith(("ipc://", "tcp://")):
            raise TargetError(f"--agent {address!r} is not an agent address (ipc://PATH or tcp://)")
    if any(a.startswith("tcp://") for a in addresses) and not transport_settings().curve_keys:
        raise TargetError(
            f"tcp agents are authenticated: set {KEYS_ENV}=DIR to their CURVE keys (the "
            "directory they got with --keys), or name their allocation with --allocation"
        )
    return Target(f"agents {', '.join(addresses)}", tuple(addresses))


def slurm_target(job: str, job_dir: str | None = None) -> Target:
    """The agents of the SLURM job with id or name `job` (of its latest run), with its keys."""
    from job import SlurmError, SlurmJob
    from job._jobdir import JobDir

    try:
        found = SlurmJob.attach(job, job_dir=job_dir, progress=None)
    except (LookupError, SlurmError) as error:
        raise TargetError(str(error)) from None
    assert found.directory is not None
    job_files = JobDir(found.directory)
    runs: dict[int, list[str]] = {}
    for path in sorted(job_files.agents_dir.glob("*.*")):
        node, _, restart = path.name.rpartition(".")
        address = path.read_text().strip() if restart.isdigit() else ""
        if node and address:
            runs.setdefault(int(restart), []).append(address)
    if not runs:
        raise TargetError(
            f"SLURM job {found.job_id} ({found.name}) has no agent running yet: its nodes write "
            f"their agents' addresses in {job_files.agents_dir} when they start"
        )
    latest = runs[max(runs)]
    return Target(
        f"SLURM job {found.job_id} ({found.name})", tuple(latest), job_files.read_spec().keys
    )
