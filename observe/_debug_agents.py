"""Which host agents a debugger front end asks: those of this user's running clients on this
host (found in their private run directories), or those of a persistent allocation."""

from __future__ import annotations

import os
import stat

from mesh._agent.allocations import read_allocation
from mesh._api.attach import use_allocation_keys
from mesh._engine.session import OWNER_FILE

#: Run directories of clients (and agent daemons) start with this, next to the front end's own.
RUN_DIR_PREFIX = "meshvisor-"


def local_agents(base: str) -> list[str]:
    """The ipc addresses of the host agents in this user's live run directories under `base`."""
    found: list[str] = []
    for entry in _entries(base):
        if entry.name.startswith(RUN_DIR_PREFIX) and _live_and_ours(entry.path):
            found.extend(
                f"ipc://{socket.path}"
                for socket in _entries(entry.path)
                if socket.name.startswith("agent-") and _is_socket(socket.path)
            )
    return sorted(found)


def allocation_agents(allocation: str) -> list[str]:
    """The agents of a persistent allocation (a name or a file), using its CURVE keys."""
    agents = read_allocation(allocation)
    if not agents:
        raise ValueError(f"allocation {allocation!r} has no agents: start them first")
    if any(agent.startswith("tcp://") for agent in agents):
        use_allocation_keys(allocation)
    return agents


def _entries(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            return list(entries)
    except OSError:
        return []


def _live_and_ours(rundir: str) -> bool:
    """Whether `rundir` is this user's and the process that made it still runs."""
    try:
        if os.stat(rundir).st_uid != os.getuid():
            return False
        with open(os.path.join(rundir, OWNER_FILE)) as owner:
            pid = int(owner.read().strip())
    except (OSError, ValueError):
        return False
    return os.path.exists(f"/proc/{pid}")


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False
