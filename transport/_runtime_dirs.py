"""Private directories for ipc socket files, under a base short enough for socket paths."""

from __future__ import annotations

import os
import tempfile

#: Longest base directory for ipc sockets, leaving room for the names meshvisor adds.
_MAX_BASE_DIR_LEN = 40


def runtime_base_dir() -> str:
    """Where `private_runtime_dir` makes directories: ``XDG_RUNTIME_DIR`` if writable and
    short (socket paths must stay under ~107 bytes), else the system temp directory."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.access(base, os.W_OK) or len(base) > _MAX_BASE_DIR_LEN:
        return tempfile.gettempdir()
    return base


def private_runtime_dir(prefix: str = "meshvisor-") -> str:
    """Create a directory only this user can enter, for ipc socket files."""
    path = tempfile.mkdtemp(prefix=prefix, dir=runtime_base_dir())
    os.chmod(path, 0o700)
    return path
