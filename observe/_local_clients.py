"""The running meshvisor clients of this user on this host, found through their private run
directories (``meshvisor-*`` beside ``owner.pid``), and the local agent each one listens with.

One place for every front end (``meshvisor top``, ``meshvisor debug``): a socket file whose
agent is gone (killed, or replaced by a new local agent of the same client) is left out, so a
stale file is never reported as an agent that does not answer."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mesh.tooling import OWNER_FILE

#: Run directories of clients (and agent daemons) start with this.
RUN_DIR_PREFIX = "meshvisor-"


def local_clients(base: str) -> list[tuple[int, str]]:
    """(client pid, agent address) of each listening agent of this user's live clients in
    `base`, sorted."""
    found: list[tuple[int, str]] = []
    listening = _listening_unix_sockets()
    for entry in sorted(Path(base).glob(f"{RUN_DIR_PREFIX}*")):
        owner = _live_owner(entry)
        if owner is None:
            continue
        for socket in sorted(entry.glob("agent-*")):
            if _is_socket(socket) and (listening is None or str(socket) in listening):
                found.append((owner, f"ipc://{socket}"))
    return found


def _listening_unix_sockets() -> set[str] | None:
    """The paths of the unix sockets that something listens on (``/proc/net/unix``: no
    connection is made, so no agent logs a refused peer); None where that cannot be read."""
    try:
        with open("/proc/net/unix") as table:
            rows = table.read().splitlines()[1:]
    except OSError:
        return None
    listening: set[str] = set()
    for row in rows:
        fields = row.split(maxsplit=7)
        if len(fields) == 8 and int(fields[3], 16) & _ACCEPTING:
            listening.add(fields[7])
    return listening


#: The flag of a listening socket in ``/proc/net/unix`` (the kernel's ``__SO_ACCEPTCON``).
_ACCEPTING = 0x10000


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
