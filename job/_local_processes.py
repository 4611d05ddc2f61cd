"""The processes of a local SLURM cluster: finding its programs, free ports, and the processes
running for one node or one cluster (read from ``/proc``), to kill them as a lost machine would."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import time
from pathlib import Path


class SlurmNotInstalled(RuntimeError):
    """SLURM's or munge's programs are not installed on this machine."""


def in_sbin(program: str) -> bool:
    return any(os.access(f"{d}/{program}", os.X_OK) for d in ("/usr/sbin", "/sbin"))


def program(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for directory in ("/usr/sbin", "/sbin"):
        if os.access(f"{directory}/{name}", os.X_OK):
            return f"{directory}/{name}"
    raise SlurmNotInstalled(f"{name} is not installed")


def free_ports(count: int) -> list[int]:
    """`count` tcp ports nothing listens on now (bound together, so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def all_pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def read_proc(pid: int, name: str) -> bytes | None:
    try:
        return (Path("/proc") / str(pid) / name).read_bytes()
    except OSError:
        return None


def parent_of(pid: int) -> int:
    """The parent of `pid` (0 if it is gone)."""
    stat = read_proc(pid, "stat")
    if stat is None:
        return 0
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


def temp_bases(pid: int) -> set[str]:
    """Where process `pid` makes its temporary directories (TMPDIR, XDG_RUNTIME_DIR)."""
    environ = (read_proc(pid, "environ") or b"").split(b"\0")
    names = (b"TMPDIR=", b"XDG_RUNTIME_DIR=")
    return {v.split(b"=", 1)[1].decode() for v in environ if v.startswith(names)}


def remove_run_dirs_of(pids: list[int], bases: set[str]) -> None:
    """Remove the meshvisor run directories (``meshvisor-*/owner.pid``) owned by `pids`."""
    owners = {str(pid) for pid in pids}
    for base in bases:
        with contextlib.suppress(OSError):
            for entry in Path(base).glob("meshvisor-*"):
                with contextlib.suppress(OSError):
                    if (entry / "owner.pid").read_text().strip() in owners:
                        shutil.rmtree(entry, ignore_errors=True)


def kill_processes_with_env(name: str, value: str) -> None:
    """SIGKILL every process of this user whose environment has ``name=value``: the step
    daemons and tasks of this cluster's jobs, which outlive a killed slurmd."""
    wanted = f"{name}={value}".encode()
    for _ in range(3):
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if wanted in environ.split(b"\0"):
                found.append(int(entry.name))
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not found:
            return
        time.sleep(0.1)
