"""`ChaosOptions`: how a chaos run goes (the allocation, the time limits, what it shows)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from job.testing import LocalSlurmCluster


@dataclass
class ChaosOptions:
    """How the harness runs: the allocation, the time limits and what it shows."""

    hosts: int = 2
    #: Where the hosts are: None for agents on this machine; on SLURM, a started
    #: `LocalSlurmCluster` or "env" (the SLURM this process's environment uses, e.g.
    #: SLURM_CONF), with one node per host plus one for the job's batch script.
    slurm: LocalSlurmCluster | Literal["env"] | None = field(default=None, repr=False)
    #: On SLURM: the partition (None: the cluster's default) and more sbatch arguments.
    slurm_partition: str | None = None
    slurm_args: tuple[str, ...] = ()
    #: How long after a fault (and its duration) the owner has to see the event.
    detect_timeout_s: float = 15.0
    #: How long a target gets to answer again after a fault, and everything after the last.
    heal_timeout_s: float = 30.0
    #: How long the workload's client may go without progress before it counts as hung.
    client_hang_s: float = 10.0
    #: Agents reap the procs of a client silent this long (a killed client's procs).
    owner_timeout_s: float = 3.0
    #: A client declares an agent it has not heard from this long unreachable.
    agent_timeout_s: float = 2.0
    #: How long a killed agent or client stays down before the harness starts it again.
    restart_delay_s: float = 0.3
    #: How long the workload has to start and register its targets.
    start_timeout_s: float = 60.0
    #: Modules the agents import before forking procs (e.g. ("torch",): procs start faster).
    preload: tuple[str, ...] = ()
    #: Parameters for the workload, as ``job.params`` (JSON values).
    params: dict[str, Any] = field(default_factory=dict)
    #: Show the output of the workload's processes (clients, agents, procs).
    verbose: bool = False
    #: Called with one line of text for every fault injected, observed and healed.
    on_update: Callable[[str], None] | None = field(default=None, repr=False)
