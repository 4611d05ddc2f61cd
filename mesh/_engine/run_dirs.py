"""Which process owns a run directory, and sweeping those whose owner died.

Apart from `session` so that a host agent, which needs only this, starts without importing the
client's and procs' runtime.
"""

from __future__ import annotations

import os
import shutil

#: File in a client's run directory naming its pid, so that a later client can tell it is stale.
OWNER_FILE = "owner.pid"


def write_owner_file(rundir: str) -> None:
    """Name this process as the owner of `rundir`, so a later one can sweep it once we die.
    Written under another name, then renamed: whoever sees the file sees the whole pid, even if
    this process is killed while writing it."""
    path = os.path.join(rundir, OWNER_FILE)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as owner:
        owner.write(str(os.getpid()))
    os.replace(partial, path)


def sweep_stale_run_dirs(base: str) -> None:
    """Remove run directories of clients and daemon agents that died without cleaning up
    (killed by SIGKILL with no local agent left to do it)."""
    for entry in os.scandir(base):
        if not entry.name.startswith("meshvisor-") or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            with open(os.path.join(entry.path, OWNER_FILE)) as owner:
                pid = int(owner.read().strip())
            if entry.stat().st_uid != os.getuid():
                continue
        except (OSError, ValueError):
            continue
        if not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(entry.path, ignore_errors=True)
