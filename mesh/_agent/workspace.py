"""`Workspaces`: the host agent's side of workspace sync (``HostMesh.sync_workspace``).

Each workspace is a folder of the agent's private run directory (``workspaces/NAME``). The
agent answers a query with its manifest (digests kept by size, mtime and inode: a file is
hashed again only when it changed), removes what the client deletes, and writes the pieces of
each changed file to a private temporary file, moved into place once its digest checks out:
a proc never imports half a file. Every path is checked again here; nothing is unpickled.
Manifests are made on a thread of their own: hashing a large workspace for the first time takes
seconds, and the agent's loop must meanwhile go on watching and serving its procs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from mesh._engine.workspace_files import (
    MAX_FILES,
    file_digest,
    name_problem,
    path_problem,
    size_problem,
    skipped,
    workspaces_root,
)
from mesh._engine.workspace_messages import (
    FileEntry,
    WorkspaceBarrier,
    WorkspaceChunk,
    WorkspaceCommit,
    WorkspaceDelete,
    WorkspaceManifest,
    WorkspaceProgress,
    WorkspaceQuery,
    WorkspaceSynced,
)
from transport import Outbox, TransportError, encode, is_address

#: A file's identity on disk, to know when its digest must be computed again.
_Stamp = tuple[int, int, int]


@dataclass
class _Partial:
    """The file being received: its temporary file, digest so far and bytes so far."""

    path: str
    size: int
    sha256: str
    executable: bool
    temp_path: str
    temp: IO[bytes]
    digest: Any = field(default_factory=hashlib.sha256)
    received: int = 0


@dataclass
class _Sync:
    """One sync under way: what it wrote and removed, and what went wrong."""

    sync_id: str
    written: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    bytes_written: int = 0
    problems: list[str] = field(default_factory=list)
    partial: _Partial | None = None


class Workspaces:
    """The workspaces of one host agent and the syncs under way."""

    def __init__(self, rundir: str, outbox: Outbox, address: str, log: Any) -> None:
        self._root = workspaces_root(rundir)
        self._outbox = outbox
        self._address = address
        self._log = log
        self._digests: dict[str, dict[str, tuple[_Stamp, str]]] = {}
        self._digests_lock = threading.Lock()  # the loop and the manifest thread share them
        self._queries: queue.SimpleQueue[WorkspaceQuery] = queue.SimpleQueue()
        self._manifest_thread: threading.Thread | None = None
        self._syncs: dict[str, _Sync] = {}
        self._handlers: dict[type, Callable[[Any], None]] = {
            WorkspaceQuery: self._on_query,
            WorkspaceDelete: self._on_delete,
            WorkspaceChunk: self._on_chunk,
            WorkspaceBarrier: self._on_barrier,
            WorkspaceCommit: self._on_commit,
        }

    def handle(self, header: object) -> bool:
        """Act on `header` if it is a workspace message; whether it was one."""
        handler = self._handlers.get(type(header))
        if handler is None:
            return False
        handler(header)
        return True

    # -- messages ------------------------------------------------------------------------------

    def _on_query(self, query: WorkspaceQuery) -> None:
        problem = name_problem(query.name)
        if problem is not None:
            self._answer_query(query, (), problem)
            return
        self._drop_sync(query.name)
        self._syncs[query.name] = _Sync(query.sync_id)
        if self._manifest_thread is None:
            self._manifest_thread = threading.Thread(
                target=self._make_manifests, name="meshvisor-workspace-manifests", daemon=True
            )
            self._manifest_thread.start()
        self._queries.put(query)

    def _make_manifests(self) -> None:
        """Answer queries in order, off the agent's loop (the client waits for the manifest
        before it sends anything more of that sync)."""
        while True:
            query = self._queries.get()
            files: tuple[FileEntry, ...] = ()
            problem = ""
            try:
                files = self._manifest(query.name)
            except OSError as error:
                problem = f"cannot read workspace {query.name!r}: {error}"
            if len(files) > MAX_FILES:
                files, problem = (), f"workspace {query.name!r} holds over {MAX_FILES} files"
            self._answer_query(query, files, problem)

    def _answer_query(self, query: WorkspaceQuery, files: tuple[FileEntry, ...], why: str) -> None:
        manifest = WorkspaceManifest(query.request_id, self._address, query.name, files, why)
        self._answer(query.reply_to, manifest)

    def _on_delete(self, request: WorkspaceDelete) -> None:
        sync = self._sync_of(request.name, request.sync_id)
        if sync is None:
            return
        for path in request.paths:
            problem = path_problem(path)
            if problem is None:
                try:
                    self._delete(request.name, path)
                except OSError as error:
                    problem = f"cannot remove {path!r}: {error}"
            if problem is None:
                sync.deleted.append(path)
            else:
                sync.problems.append(problem)

    def _on_chunk(self, chunk: WorkspaceChunk) -> None:
        sync = self._sync_of(chunk.name, chunk.sync_id)
        if sync is None or sync.problems:
            return  # a failed sync writes nothing more; its commit says why
        try:
            problem = self._take_chunk(sync, chunk)
        except OSError as error:
            problem = f"cannot write {chunk.path!r}: {error}"
        if problem is not None:
            sync.problems.append(problem)
            self._discard_partial(sync)

    def _on_barrier(self, barrier: WorkspaceBarrier) -> None:
        sync = self._sync_of(barrier.name, barrier.sync_id)
        if sync is None:
            sync = _Sync(barrier.sync_id, problems=["the sync was replaced by a newer one"])
        progress = WorkspaceProgress(
            barrier.request_id, self._address, sync.bytes_written, _why(sync)
        )
        self._answer(barrier.reply_to, progress)

    def _on_commit(self, commit: WorkspaceCommit) -> None:
        sync = self._sync_of(commit.name, commit.sync_id)
        if sync is None:
            sync = _Sync(commit.sync_id, problems=["the sync was replaced by a newer one"])
        elif sync.partial is not None:
            sync.problems.append(f"file {sync.partial.path!r} arrived incomplete")
        if sync is self._syncs.get(commit.name):
            self._drop_sync(commit.name)
            self._save_digests(commit.name)
        answer = WorkspaceSynced(
            commit.request_id,
            self._address,
            self._folder(commit.name),
            tuple(sync.written),
            tuple(sync.deleted),
            sync.bytes_written,
            _why(sync),
        )
        self._log.info(
            "workspace_synced",
            name=commit.name,
            written=len(sync.written),
            deleted=len(sync.deleted),
            problems=len(sync.problems),
        )
        self._answer(commit.reply_to, answer)

    # -- files ---------------------------------------------------------------------------------

    def _take_chunk(self, sync: _Sync, chunk: WorkspaceChunk) -> str | None:
        """Write `chunk`; why it cannot be taken, or None."""
        problem = path_problem(chunk.path) or size_problem(chunk.path, chunk.size)
        if problem is not None:
            return problem
        partial = sync.partial
        if chunk.offset == 0:
            self._discard_partial(sync)
            partial = sync.partial = self._start_partial(chunk)
        if partial is None or partial.path != chunk.path or partial.received != chunk.offset:
            return f"a piece of {chunk.path!r} arrived out of order (at byte {chunk.offset})"
        if partial.received + len(chunk.data) > partial.size:
            return f"file {chunk.path!r} got more than the {partial.size} bytes announced"
        partial.temp.write(chunk.data)
        partial.digest.update(chunk.data)
        partial.received += len(chunk.data)
        sync.bytes_written += len(chunk.data)
        if partial.received == partial.size:
            sync.partial = None
            return self._finish(sync, chunk.name, partial)
        return None

    def _start_partial(self, chunk: WorkspaceChunk) -> _Partial:
        spool = os.path.join(self._root, ".incoming")
        os.makedirs(spool, mode=0o700, exist_ok=True)
        handle, temp_path = tempfile.mkstemp(dir=spool)
        temp = os.fdopen(handle, "wb")
        return _Partial(chunk.path, chunk.size, chunk.sha256, chunk.executable, temp_path, temp)

    def _finish(self, sync: _Sync, name: str, partial: _Partial) -> str | None:
        """Check the digest of a received file and move it into place."""
        partial.temp.close()
        temp_path = partial.temp_path
        if partial.digest.hexdigest() != partial.sha256:
            os.unlink(temp_path)
            return f"file {partial.path!r} arrived with another digest than announced"
        os.chmod(temp_path, 0o700 if partial.executable else 0o600)
        target = self._target(name, partial.path)
        os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)  # a folder became a file
        os.replace(temp_path, target)
        self._remember(name, partial.path, target, partial.sha256)
        sync.written.append(partial.path)
        return None

    def _delete(self, name: str, path: str) -> None:
        target = self._target(name, path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
        with self._digests_lock:
            self._digests.get(name, {}).pop(path, None)
        folder, top = os.path.dirname(target), self._folder(name)
        while folder != top:  # folders left empty go too
            try:
                os.rmdir(folder)
            except OSError:
                break
            folder = os.path.dirname(folder)

    def _target(self, name: str, path: str) -> str:
        """Where `path` of workspace `name` lives; OSError if a symlink would lead out."""
        top = self._folder(name)
        target = os.path.join(top, *path.split("/"))
        parent = os.path.realpath(os.path.dirname(target))
        if os.path.commonpath([top, parent]) != top:
            raise OSError(f"{path!r} leads out of the workspace")
        return target

    def _discard_partial(self, sync: _Sync) -> None:
        if sync.partial is not None:
            sync.partial.temp.close()
            with contextlib.suppress(OSError):
                os.unlink(sync.partial.temp_path)
            sync.partial = None

    # -- manifests -----------------------------------------------------------------------------

    def _manifest(self, name: str) -> tuple[FileEntry, ...]:
        """The files of workspace `name`, hashing only those that changed since last seen."""
        top = self._folder(name)
        os.makedirs(top, mode=0o700, exist_ok=True)
        with self._digests_lock:
            known = dict(self._digests.get(name) or self._load_digests(name))
        fresh: dict[str, tuple[_Stamp, str]] = {}
        files = []
        for folder, dirs, names in os.walk(top):
            dirs[:] = [d for d in dirs if not skipped(d, True)]
            for file_name in names:
                full = os.path.join(folder, file_name)
                info = os.lstat(full)
                if skipped(file_name, False) or not stat.S_ISREG(info.st_mode):
                    continue
                path = os.path.relpath(full, top).replace(os.sep, "/")
                stamp = (info.st_size, info.st_mtime_ns, info.st_ino)
                seen = known.get(path)
                digest = seen[1] if seen is not None and seen[0] == stamp else file_digest(full)
                fresh[path] = (stamp, digest)
                files.append((path, digest, info.st_size, bool(info.st_mode & stat.S_IXUSR)))
        with self._digests_lock:
            self._digests[name] = fresh
        return tuple(files)

    def _digests_file(self, name: str) -> str:
        return os.path.join(self._root, f".digests-{name}.json")

    def _load_digests(self, name: str) -> dict[str, tuple[_Stamp, str]]:
        """The digests a previous agent in this run directory saved (none if unreadable):
        a restarted agent hashes only the files that changed since."""
        try:
            with open(self._digests_file(name)) as file:
                saved = json.load(file)
            return {path: (tuple(stamp), digest) for path, (stamp, digest) in saved.items()}
        except (OSError, ValueError, TypeError):
            return {}

    def _save_digests(self, name: str) -> None:
        """Keep the digests of workspace `name` for the next agent in this run directory."""
        temp_path = f"{self._digests_file(name)}.{os.getpid()}"
        with contextlib.suppress(OSError):
            with self._digests_lock:
                digests = dict(self._digests.get(name, {}))
            with open(os.open(temp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump(digests, f)
            os.replace(temp_path, self._digests_file(name))

    def _remember(self, name: str, path: str, target: str, digest: str) -> None:
        info = os.stat(target)
        stamp = (info.st_size, info.st_mtime_ns, info.st_ino)
        with self._digests_lock:
            self._digests.setdefault(name, {})[path] = (stamp, digest)

    def _folder(self, name: str) -> str:
        return os.path.join(os.path.realpath(self._root), name)

    def _sync_of(self, name: str, sync_id: str) -> _Sync | None:
        """The sync `sync_id` of workspace `name` if it is the one under way."""
        sync = self._syncs.get(name)
        return sync if sync is not None and sync.sync_id == sync_id else None

    def _drop_sync(self, name: str) -> None:
        sync = self._syncs.pop(name, None)
        if sync is not None:
            self._discard_partial(sync)

    def _answer(self, reply_to: str, answer: object) -> None:
        if not is_address(reply_to):
            self._log.warning("message_rejected", kind=type(answer).__name__, reason="bad reply_to")
            return
        try:
            self._outbox.send(reply_to, encode(answer))
        except TransportError as error:
            self._log.warning("workspace_answer_not_sent", to=reply_to, reason=str(error))


def _why(sync: _Sync) -> str:
    """What went wrong in `sync` ("" if nothing), in a few sentences."""
    if not sync.problems:
        return ""
    more = f" (and {len(sync.problems) - 3} more)" if len(sync.problems) > 3 else ""
    return "; ".join(sync.problems[:3]) + more
