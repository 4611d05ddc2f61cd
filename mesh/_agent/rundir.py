"""The host agent's run directory: the private folder of its procs' ipc sockets.

A daemon without ``--rundir`` makes a fresh one, marked as its own so that the next meshvisor
process sweeps it if the agent is killed. Socket files that killed procs could not remove are
removed by the agent: a proc's when it exits, all stale ones when a daemon starts.
"""

from __future__ import annotations

import contextlib
import glob
import os
import stat

from mesh._engine.run_dirs import sweep_stale_run_dirs, write_owner_file
from transport import private_runtime_dir


def own_run_dir() -> str:
    """A new private run directory for a daemon, marked as this process's so that the next
    meshvisor process sweeps it if this one is killed; stale ones are swept now."""
    rundir = private_runtime_dir("meshvisor-agent-")
    write_owner_file(rundir)
    sweep_stale_run_dirs(os.path.dirname(rundir))
    return rundir


def remove_proc_sockets(rundir: str, proc_id: str) -> None:
    """Remove the socket (and hand-over) files of a proc that exited: a killed one could not."""
    for path in (
        os.path.join(rundir, proc_id),
        os.path.join(rundir, f"{proc_id}.bootstrap"),  # a launched proc that never read it
        *glob.glob(os.path.join(glob.escape(rundir), f"{glob.escape(proc_id)}-r*")),
    ):
        with contextlib.suppress(OSError):
            os.unlink(path)


def remove_stale_sockets(rundir: str, keep: str) -> None:
    """Remove the sockets (and evidence files) that procs of a previous agent left in `rundir`
    (a restarted agent reuses its directory; its old procs were killed with the old agent)."""
    try:
        entries = list(os.scandir(rundir))
    except OSError:
        return
    for entry in entries:
        path = entry.path
        mode = entry.stat(follow_symlinks=False).st_mode
        stale_evidence = stat.S_ISREG(mode) and path.endswith((".stacks", ".oom"))
        if f"ipc://{path}" != keep and (stat.S_ISSOCK(mode) or stale_evidence):
            with contextlib.suppress(OSError):
                os.unlink(path)
