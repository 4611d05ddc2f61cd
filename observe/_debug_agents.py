"""Which host agents a debugger front end asks: those of this user's running clients on this
host (found in their private run directories), or those of a persistent allocation."""

from __future__ import annotations

from mesh.tooling import read_allocation, use_allocation_keys
from observe._local_clients import local_clients


def local_agents(base: str) -> list[str]:
    """The ipc addresses of the host agents of this user's live clients under `base`."""
    return sorted(address for _, address in local_clients(base))


def allocation_agents(allocation: str) -> list[str]:
    """The agents of a persistent allocation (a name or a file), using its CURVE keys."""
    agents = read_allocation(allocation)
    if not agents:
        raise ValueError(f"allocation {allocation!r} has no agents: start them first")
    if any(agent.startswith("tcp://") for agent in agents):
        use_allocation_keys(allocation)
    return agents
