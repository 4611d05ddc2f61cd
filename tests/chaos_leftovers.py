"""Checks that chaos runs leave nothing behind: shared by the chaos test modules.

Import `nothing_left_behind` into a test module to make it an autouse fixture there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from polling import pid_alive, wait_until

GONE_TIMEOUT_S = 15.0


def run_base() -> str:
    return os.environ["XDG_RUNTIME_DIR"]


def leftover_dirs() -> list[Path]:
    """Run directories that no finished run may leave: every chaos allocation's, and every
    client session's but this process's own (chaos clients are other processes)."""
    found = []
    for path in Path(run_base()).glob("meshvisor-*"):
        if path.name.startswith("meshvisor-chaos-"):
            found.append(path)
            continue
        try:
            owner = int((path / "owner.pid").read_text().strip())
        except (OSError, ValueError):
            continue
        if owner != os.getpid():
            found.append(path)
    return sorted(found)


def chaos_processes() -> list[tuple[int, str]]:
    """(pid, cmdline) of live processes of a chaos allocation of this session: agents, fork
    servers and procs (their command line names the allocation's directory) and clients (their
    ``--agents`` do)."""
    marker = f"{run_base()}/meshvisor-chaos-"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and pid_alive(int(entry.name)):
            found.append((int(entry.name), cmdline.strip()))
    return found


Snapshot = tuple[set[int], set[Path]]


def snapshot() -> Snapshot:
    """What was there before a test or a run (left by others: not ours to judge)."""
    return {pid for pid, _ in chaos_processes()}, set(leftover_dirs())


def clean_up(before: Snapshot) -> list[str]:
    """Wait a little for the processes of finished runs to go, then remove whatever they left
    (so that a failure leaves nothing behind either); returns what was left."""

    def processes() -> list[tuple[int, str]]:
        return [(pid, cmd) for pid, cmd in chaos_processes() if pid not in before[0]]

    with contextlib.suppress(AssertionError):
        wait_until(lambda: not processes(), GONE_TIMEOUT_S, "chaos processes to exit")
    left = processes()
    for pid, _ in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    dirs = [path for path in leftover_dirs() if path not in before[1]]
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)
    return [f"process left behind: {p}" for p in left] + [
        f"directory left behind: {d}" for d in dirs
    ]


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    before = snapshot()
    yield
    left = clean_up(before)
    assert not left, left
