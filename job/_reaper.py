"""Cancels a non-persistent SLURM job when the client that started it exits, however it exits.

The reaper (`main`, given CLIENT_PID and JOB_ID) runs in a session of its own (so a signal to the
client's process group spares it) and waits for the client with a pidfd; when the client is
gone, even SIGKILLed, it cancels the job. The client ends it when it cancels the job itself.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys

from job._scheduler import SlurmError, cancel

#: Run as ``-c`` rather than ``-m job._reaper``: the `job` package imports this module.
_ENTRY = "import sys; from job._reaper import main; sys.exit(main(sys.argv[1:]))"


def start_reaper(job_id: str) -> subprocess.Popen[bytes]:
    """Start the reaper of `job_id` for this process."""
    return subprocess.Popen(
        [sys.executable, "-c", _ENTRY, str(os.getpid()), job_id],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    client_pid, job_id = int(args[0]), args[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the client cancels it itself
    try:
        fd = os.pidfd_open(client_pid)
    except ProcessLookupError:
        fd = None  # already gone
    if fd is not None:
        with contextlib.closing(os.fdopen(fd)):
            select.select([fd], [], [])
    try:
        cancel(job_id)
    except SlurmError as error:
        print(f"meshvisor: could not cancel SLURM job {job_id}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
