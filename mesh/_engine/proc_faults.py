"""What a proc records about its own death, for its host agent to report (`mesh._agent.evidence`).

- Its Python stacks: faulthandler writes them to a private file of the agent's run directory
  on a fatal signal (segfault, bus error, abort...) and on `DUMP_SIGNAL`, which the agent
  sends to a proc it declared hung; for that one faulthandler chains to the signal's default
  action afterwards, so the proc dies of it once its stacks are written.
- Its memory limit (``spawn_procs(memory_limit=...)``): enforced as ``RLIMIT_DATA``, the
  private writable memory (heap, anonymous mappings) it allocates on top of what it started
  with (what it inherited from its fork server). An allocation past it fails with
  ``MemoryError``; one that escapes an endpoint or a constructor kills the proc, as the
  kernel's OOM killer would, after writing a note with the figures and the allocating stack.
"""

from __future__ import annotations

import faulthandler
import os
import re
import resource
import signal
import threading
import traceback
from typing import IO

#: The signal that makes a proc dump the stacks of all its threads, then die of it.
DUMP_SIGNAL: int | None = signal.SIGRTMIN + 8 if hasattr(signal, "SIGRTMIN") else None
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)

_stacks_file: IO[bytes] | None = None  # kept open for faulthandler's C handlers
_memory_limit: tuple[int, str, str] | None = None  # (bytes, note path, stacks path)


def stacks_path(rundir: str, proc_id: str) -> str:
    """Where proc `proc_id` writes its stacks when it dies of a fault or is dumped."""
    return os.path.join(rundir, f"{proc_id}.stacks")


def oom_note_path(rundir: str, proc_id: str) -> str:
    """Where proc `proc_id` says that it ran out of memory, with the figures."""
    return os.path.join(rundir, f"{proc_id}.oom")


def record_stacks_on_faults(rundir: str, proc_id: str) -> None:
    """From now on, a fatal signal or `DUMP_SIGNAL` writes this proc's stacks to its file."""
    global _stacks_file
    path = stacks_path(rundir, proc_id)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return  # no evidence then (e.g. the run directory is gone), but the proc runs
    _stacks_file = os.fdopen(fd, "wb", buffering=0)
    faulthandler.enable(_stacks_file, all_threads=True)
    if DUMP_SIGNAL is not None:
        faulthandler.register(DUMP_SIGNAL, _stacks_file, all_threads=True, chain=True)


def limit_memory(limit_bytes: int, rundir: str, proc_id: str) -> None:
    """Let this proc allocate at most `limit_bytes` of private writable memory (0: no limit)
    on top of what it started with: a proc forked from a fork server inherits the server's
    mappings (torch, when preloaded, maps hundreds of MiB), which `RLIMIT_DATA` counts."""
    global _memory_limit
    if limit_bytes <= 0:
        return
    cap = _data_bytes() + limit_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    paths = oom_note_path(rundir, proc_id), stacks_path(rundir, proc_id)
    _memory_limit = (limit_bytes, *paths)


def _data_bytes() -> int:
    """This process's private writable memory now (``VmData``), 0 if it cannot be read."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def die_if_out_of_memory(error: BaseException) -> None:
    """If `error` is a MemoryError of a proc with a memory limit: note it and die (SIGKILL)."""
    if _memory_limit is None or not isinstance(error, MemoryError):
        return
    limit, note_path, stacks = _memory_limit
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    note = (
        f"an allocation failed at its memory limit of "
        f"{format_bytes(limit)} (memory_limit, enforced as RLIMIT_DATA); peak RSS "
        f"{format_bytes(peak)}"
    )
    _write(note_path, note.encode(), os.O_TRUNC)
    trace = "".join(traceback.format_exception(error)).encode("utf-8", "replace")
    _write(stacks, b"The allocation that failed:\n" + trace, os.O_APPEND)
    signal_this_process(signal.SIGKILL)


def signal_this_process(signum: int) -> None:
    """Send `signum` to this process through the calling thread, so that a stop or a kill
    takes hold before this thread runs on: ``kill(getpid())`` lets it run on until the kernel
    gets round to stopping it (another thread is picked to take the signal first)."""
    signal.pthread_kill(threading.get_ident(), signum)


def _write(path: str, data: bytes, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | mode, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError:
        pass  # the proc dies anyway; its report then lacks the figures


def parse_memory_limit(value: int | str | None) -> int:
    """`value` in bytes: an int, or a string such as ``"512MiB"``, ``"2G"``, ``"1.5GB"``
    (units are powers of 1024); 0 for None. Raises ValueError or TypeError for others."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"memory_limit must be bytes (int) or a size such as '2GiB', not {value!r}")
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match is None:
            raise ValueError(
                f"memory_limit {value!r} is not a size: write bytes or a number with a unit "
                "such as '512MiB', '2G' or '1.5GB' (k, M, G, T; powers of 1024)"
            )
        value = int(float(match[1]) * _UNITS[match[2].lower()])
    if value < 1 << 20:
        raise ValueError(
            f"memory_limit of {value} bytes is too small for a Python process: give at least "
            "1 MiB (a proc needs tens of MiB)"
        )
    return value


def format_bytes(size: int) -> str:
    """`size` for people: ``512.0 MiB``, ``2.0 GiB``."""
    amount, unit = float(size), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if amount < 1024 or unit == "TiB":
            break
        amount /= 1024
    return f"{amount:.1f} {unit}" if unit != "B" else f"{size} B"
