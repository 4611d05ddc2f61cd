"""Per-rank log files: every line each proc prints, kept by the fork server that reads it.

The fork server reads every proc's stdout and stderr, whether the lines go on to the agent's
output or to the owner, so it is the one that sees them all: it appends each line as a record
(`log_records`) to ``DIR/PROC_ID.log``, private (0600 in a 0700 directory), and rotates the
file by size: ``PROC_ID.log`` becomes ``PROC_ID.log.1`` and so on, the oldest beyond
`LogFileConfig.max_files` removed. Writing a regular file never waits for a reader, so neither
the fork server nor the proc waits for a client; a write that fails (disk full) is counted,
and said in the file once writing works again.

DIR is the agent's ``--log-dir``; by default one directory per run under `logs_home`:
``run-STAMP-PID`` for a client's local agent, ``allocation-NAME`` for a persistent
allocation's daemons, ``agent-STAMP-PID`` for other daemons. A SLURM job's agents write to
``JOBDIR/logs``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh._agent.log_records import RecordEncoder
from mesh._settings import current_settings

#: Where the runs' log directories go (default: $MESHVISOR_HOME/logs, i.e. ~/.meshvisor/logs).
LOG_HOME_ENV = "MESHVISOR_LOG_DIR"
#: The size at which a proc's log file is rotated.
FILE_BYTES_ENV = "MESHVISOR_LOG_FILE_BYTES"
#: How many files each proc keeps (the one written included); 0 keeps no log files.
FILES_ENV = "MESHVISOR_LOG_FILES"
DEFAULT_FILE_BYTES = 16 * 1024 * 1024
DEFAULT_FILES = 5
#: How many ``run-*`` (and ``agent-*``) directories `logs_home` keeps (the oldest removed).
KEPT_RUNS = 50
RUN_PREFIX = "run-"
AGENT_PREFIX = "agent-"
ALLOCATION_PREFIX = "allocation-"


@dataclass(frozen=True)
class LogFileConfig:
    """Where a fork server keeps its procs' log files, and how they are rotated."""

    directory: str
    max_bytes: int = DEFAULT_FILE_BYTES
    max_files: int = DEFAULT_FILES

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int):
            raise TypeError(f"the log file size must be a number of bytes, not {self.max_bytes!r}")
        if self.max_bytes < 1024:
            raise ValueError(f"the log file size must be at least 1024 bytes, not {self.max_bytes}")
        if isinstance(self.max_files, bool) or not isinstance(self.max_files, int):
            raise TypeError(f"the number of log files must be an integer, not {self.max_files!r}")
        if self.max_files < 0:
            raise ValueError(f"the number of log files must be >= 0, not {self.max_files}")

    @classmethod
    def from_env(cls, directory: str, environ: Mapping[str, str] = os.environ) -> LogFileConfig:
        """The rotation that `FILE_BYTES_ENV` and `FILES_ENV` ask for, defaults for unset ones;
        ValueError naming the variable for a bad value."""
        return cls(
            directory,
            _int_env(environ, FILE_BYTES_ENV, DEFAULT_FILE_BYTES),
            _int_env(environ, FILES_ENV, DEFAULT_FILES),
        )


def _int_env(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} must be an integer (e.g. {default}); "
            "fix or unset it"
        ) from None


def logs_home(environ: Mapping[str, str] = os.environ) -> Path:
    """The directory under which runs keep their log directories."""
    return Path(environ.get(LOG_HOME_ENV) or current_settings().allocations_home / "logs")


def default_log_dir(owner_pid: int | None, allocation: str | None) -> Path:
    """The log directory of an agent started without ``--log-dir`` (see the module doc)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if allocation:
        return logs_home() / f"{ALLOCATION_PREFIX}{Path(allocation).name}"
    if owner_pid is not None:
        return logs_home() / f"{RUN_PREFIX}{stamp}-{owner_pid}"
    return logs_home() / f"{AGENT_PREFIX}{stamp}-{os.getpid()}"


def prepare_log_dir(directory: Path) -> None:
    """Create `directory` private (0700, parents too); in `logs_home`, drop the oldest runs
    of its kind (``run-``, ``agent-``) beyond `KEPT_RUNS` (allocations keep theirs)."""
    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    if directory.parent != logs_home():
        return
    for prefix in (RUN_PREFIX, AGENT_PREFIX):
        if directory.name.startswith(prefix):
            runs = sorted(directory.parent.glob(f"{prefix}*"), key=_modified)
            for old in runs[:-KEPT_RUNS]:
                shutil.rmtree(old, ignore_errors=True)


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


class RankLog:
    """The log file of one proc, appended to by the relays of its stdout and stderr."""

    def __init__(self, config: LogFileConfig, proc: dict[str, Any], pid: int, host: str) -> None:
        self._config = config
        self.path = os.path.join(config.directory, f"{proc['proc_id']}.log")
        self._encoder = RecordEncoder(proc, pid, host)
        self._fd: int | None = None
        self._size = 0
        self._lost = 0
        self._users = 2  # the relays of stdout and stderr

    @property
    def fd(self) -> int | None:
        """The open file's descriptor (a proc forked later must close it), None if closed."""
        return self._fd

    def write(self, stream: int, lines: list[bytes]) -> None:
        """Append `lines` (read from `stream` just now) as records; never raises."""
        texts = b"\n".join(lines).decode("utf-8", "replace").split("\n")
        data = self._encoder.encode(time.time(), stream, texts)
        if self._lost:
            notice = f"[meshvisor] {self._lost} lines could not be written to this log file"
            data = self._encoder.encode(time.time(), 2, [notice]) + data
        try:
            self._append(data)
        except OSError:
            self._lost += len(texts)
        else:
            self._lost = 0

    def release(self) -> None:
        """One relay is done (its pipe closed); the file is closed when both are."""
        self._users -= 1
        if self._users <= 0:
            self.close()

    def close(self) -> None:
        """Close the file (a later write opens it again)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _append(self, data: bytes) -> None:
        """Write `data` (whole records), rotating first wherever the file would grow past its
        limit; a single record longer than the limit gets a file of its own."""
        limit = self._config.max_bytes
        while data:
            if self._fd is None:
                self._open()
            room = limit - self._size
            cut = len(data) if len(data) <= room else data.rfind(b"\n", 0, room) + 1
            if cut == 0:
                if self._size > 0:
                    self._rotate()
                    continue
                cut = data.find(b"\n") + 1 or len(data)
            self._write_all(data[:cut])
            data = data[cut:]
            if data:
                self._rotate()

    def _write_all(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            self._size += written
            view = view[written:]

    def _open(self) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        self._fd = os.open(self.path, flags, 0o600)
        self._size = os.fstat(self._fd).st_size

    def _rotate(self) -> None:
        """``X.log`` → ``X.log.1`` → ... → ``X.log.N-1``; the oldest beyond N is removed."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        keep = self._config.max_files
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{self.path}.{keep - 1}" if keep > 1 else self.path)
        for index in range(keep - 2, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{self.path}.{index}", f"{self.path}.{index + 1}")
        if keep > 1:
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.path, f"{self.path}.1")
        self._size = 0
