"""The rules of a synced workspace, shared by the client and the host agents: which names and
paths are allowed, the limits on sizes, and how a directory tree becomes a manifest."""

from __future__ import annotations

import hashlib
import os
import re
import stat

#: The folder of an agent's run directory that holds its workspaces, one folder per name.
WORKSPACES = "workspaces"
#: The variable that tells a proc where its host's workspaces are (set by its agent).
WORKSPACES_ENV = "MESHVISOR_WORKSPACES"
#: The largest file a workspace takes, all its files together, and how many files.
MAX_FILE_BYTES = 2 << 30
MAX_TOTAL_BYTES = 16 << 30
MAX_FILES = 10_000
#: The longest relative path, and the deepest.
MAX_PATH_CHARS = 1024
MAX_DEPTH = 32
#: Names never synced: caches Python and git rebuild on their own.
SKIPPED_DIRS = frozenset({"__pycache__", ".git", ".hg", ".mypy_cache", ".pytest_cache"})
SKIPPED_SUFFIXES = (".pyc", ".pyo")
#: What a piece of a file holds at most (a header field: well under MAX_HEADER_BYTES).
CHUNK_BYTES = 1 << 20

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")


class WorkspaceError(ValueError):
    """A workspace cannot be synced: a bad path, a symlink leaving it, a size over the limits,
    or a host agent that refused or did not answer."""


def workspaces_root(rundir: str) -> str:
    """The folder of the workspaces of the host agent of run directory `rundir`."""
    return os.path.join(rundir, WORKSPACES)


def name_problem(name: object) -> str | None:
    """Why `name` cannot name a workspace, or None."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return (
            f"workspace name {name!r} must be 1 to 64 letters, digits, '.', '_' or '-', not "
            "starting with '.' or '-'"
        )
    return None


def path_problem(path: object) -> str | None:
    """Why `path` cannot be a file of a workspace (absolute, '..', too long...), or None."""
    if not isinstance(path, str) or not path:
        return f"file path {path!r} must be a non-empty string"
    if len(path) > MAX_PATH_CHARS or "\0" in path or "\\" in path:
        return f"file path {path[:80]!r} is longer than {MAX_PATH_CHARS} or holds NUL or '\\'"
    parts = path.split("/")
    if path.startswith("/") or any(part in ("", ".", "..") for part in parts):
        return f"file path {path[:80]!r} must be relative, without '.', '..' or empty parts"
    if len(parts) > MAX_DEPTH:
        return f"file path {path[:80]!r} is nested deeper than {MAX_DEPTH} folders"
    return None


def size_problem(path: str, size: object) -> str | None:
    """Why a file of `size` bytes cannot be synced, or None."""
    if not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
        return f"file {path!r} has {size} bytes, over the limit of {MAX_FILE_BYTES} bytes"
    return None


def file_digest(path: str) -> str:
    """The sha256 hex digest of the file at `path`, read in pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while piece := file.read(CHUNK_BYTES):
            digest.update(piece)
    return digest.hexdigest()


class DigestCache:
    """The digests of files by path, computed again only when a file's size, mtime or inode
    changed (as rsync judges files): a re-sync of a large tree hashes only what was edited."""

    def __init__(self, limit: int = 4 * MAX_FILES) -> None:
        self._limit = limit
        self._known: dict[str, tuple[tuple[int, int, int], str]] = {}

    def digest(self, path: str) -> str:
        info = os.stat(path)
        stamp = (info.st_size, info.st_mtime_ns, info.st_ino)
        seen = self._known.get(path)
        if seen is not None and seen[0] == stamp:
            return seen[1]
        digest = file_digest(path)
        if len(self._known) >= self._limit:
            self._known.clear()
        self._known[path] = (stamp, digest)
        return digest


def skipped(name: str, is_dir: bool) -> bool:
    """Whether a file or folder called `name` stays out of workspaces."""
    return name in SKIPPED_DIRS if is_dir else name.endswith(SKIPPED_SUFFIXES)


def local_tree(root: str) -> dict[str, tuple[str, int, bool]]:
    """The files under `root` to sync: relative path -> (absolute path, size, executable).
    WorkspaceError for a symlink leaving `root`, a bad path or sizes over the limits."""
    real_root = os.path.realpath(root)
    if not os.path.isdir(real_root):
        raise WorkspaceError(f"cannot sync {root!r}: it is not a directory")
    files: dict[str, tuple[str, int, bool]] = {}
    seen_dirs = {real_root}
    pending = [(real_root, "")]
    while pending:
        folder, prefix = pending.pop()
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            relative = f"{prefix}{entry.name}"
            target = _inside(real_root, entry.path, relative, root)
            if os.path.isdir(target):
                if not skipped(entry.name, True) and target not in seen_dirs:
                    seen_dirs.add(target)
                    pending.append((target, f"{relative}/"))
            elif not skipped(entry.name, False):
                files[relative] = _local_file(target, relative, root)
    _check_totals(root, files)
    return files


def _inside(real_root: str, path: str, relative: str, root: str) -> str:
    """The real path of `path`; WorkspaceError if a symlink leads out of `real_root`."""
    target = os.path.realpath(path)
    if os.path.commonpath([real_root, target]) != real_root:
        raise WorkspaceError(
            f"cannot sync {root!r}: {relative!r} is a symlink to {target!r}, outside the "
            "directory; remove the link or copy what it points to into the directory"
        )
    return target


def _local_file(path: str, relative: str, root: str) -> tuple[str, int, bool]:
    problem = path_problem(relative)
    info = os.stat(path)
    if problem is None and not stat.S_ISREG(info.st_mode):
        problem = f"{relative!r} is not a regular file (a socket, fifo or device)"
    problem = problem or size_problem(relative, info.st_size)
    if problem is not None:
        raise WorkspaceError(f"cannot sync {root!r}: {problem}")
    return path, info.st_size, bool(info.st_mode & stat.S_IXUSR)


def _check_totals(root: str, files: dict[str, tuple[str, int, bool]]) -> None:
    total = sum(size for _, size, _ in files.values())
    if len(files) > MAX_FILES or total > MAX_TOTAL_BYTES:
        raise WorkspaceError(
            f"cannot sync {root!r}: it holds {len(files)} files of {total} bytes, over the "
            f"limits of {MAX_FILES} files and {MAX_TOTAL_BYTES} bytes; sync a smaller folder"
        )
