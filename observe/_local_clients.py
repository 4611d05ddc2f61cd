"""The running meshvisor clients of this user on this host, found through their private run
directories (``meshvisor-*`` beside ``owner.pid``), and the local agent each one listens with.

One place for every front end (``meshvisor top``, ``meshvisor debug``): a socket file whose
agent is gone (killed, or replaced by a new local agent of the same client) is left out, so a
stale file is never reported as an agent that does not answer."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mesh._agent.allocations import agent_gone
from mesh._engine.session import OWNER_FILE

#: Run directories of clients (and agent daemons) start with this.
RUN_DIR_PREFIX = "meshvisor-"


def local_clients(base: str) -> list[tuple[int, str]]:
    """(client pid, agent address) of each listening agent of this user's live clients in
    `base`, sorted."""
    found: list[tuple[int, str]] = []
    for entry in sorted(Path(base).glob(f"{RUN_DIR_PREFIX}*")):
        owner = _live_owner(entry)
        if owner is None:
            continue
        for socket in sorted(entry.glob("agent-*")):
            address = f"ipc://{socket}"
            if _is_socket(socket) and not agent_gone(address):
                found.append((owner, address))
    return found


def _live_owner(rundir: Path) -> int | None:
    """The pid of the process that made `rundir` if it is this user's and still runs."""
    try:
        if rundir.stat().st_uid != os.getuid():
            return None
        pid = int((rundir / OWNER_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if os.path.exists(f"/proc/{pid}") else None


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.lstat().st_mode)
    except OSError:
        return False
