"""Workspace sync: copy a local directory (your code) to every host agent of a host mesh,
sending only what changed, so that procs import it (``HostMesh.sync_workspace``).

The client asks each agent for its manifest (path, sha256, size, executable bit), removes what
is gone, and sends the changed files in pieces of `CHUNK_BYTES` as plain bytes over the
authenticated channel, with at most two windows of `WINDOW_BYTES` unacknowledged per agent:
memory stays bounded whatever the tree. The summary comes from what the agents wrote.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from mesh._engine.future import Future
from mesh._engine.runtime import Runtime
from mesh._engine.workspace_files import CHUNK_BYTES, DigestCache, WorkspaceError, local_tree
from mesh._engine.workspace_messages import (
    FileEntry,
    WorkspaceBarrier,
    WorkspaceChunk,
    WorkspaceCommit,
    WorkspaceDelete,
    WorkspaceQuery,
)
from transport import encode

#: Bytes sent to an agent between two acknowledgements (two windows may be in flight).
WINDOW_BYTES = 8 << 20
#: A sync that sends at least this much prints its progress (with ``progress=True``).
PROGRESS_MIN_BYTES = 4 << 20
#: The digests of the local files this process synced, to hash only what changed since.
_DIGESTS = DigestCache()


@dataclass(frozen=True)
class SyncProgress:
    """How far a sync is: bytes and files sent of those it must send."""

    bytes_sent: int
    bytes_total: int
    files_sent: int
    files_total: int


@dataclass(frozen=True)
class HostSync:
    """What one host agent wrote and removed in a sync, as it reported it, and the folder of
    the workspace on that host (on the ``sys.path`` of procs spawned there from now on)."""

    agent: str
    path: str
    written: tuple[str, ...]
    deleted: tuple[str, ...]
    bytes_written: int


@dataclass(frozen=True)
class WorkspaceSync:
    """The outcome of ``HostMesh.sync_workspace``: per host what travelled, and the modules
    reloaded (``reload="modules"``) or procs restarted (``reload="restart"``)."""

    name: str
    local_dir: str
    hosts: tuple[HostSync, ...]
    reloaded: tuple[str, ...] = ()
    restarted: int = 0

    @property
    def written(self) -> frozenset[str]:
        """The files written on at least one host."""
        return frozenset(path for host in self.hosts for path in host.written)

    @property
    def deleted(self) -> frozenset[str]:
        """The files removed on at least one host."""
        return frozenset(path for host in self.hosts for path in host.deleted)

    @property
    def bytes_written(self) -> int:
        return sum(host.bytes_written for host in self.hosts)


ProgressCallback = Callable[[SyncProgress], None]


def sync_files(
    runtime: Runtime,
    agents: Sequence[str],
    local_dir: str,
    name: str,
    progress: bool | ProgressCallback,
    timeout_s: float,
) -> WorkspaceSync:
    """Sync `local_dir` as workspace `name` to `agents`; WorkspaceError naming the agent and
    the reason when one refuses or does not answer within `timeout_s`."""
    tree = local_tree(local_dir)
    local = {path: (_DIGESTS.digest(full), size, exe) for path, (full, size, exe) in tree.items()}
    sync = _Sync(runtime, list(agents), name, timeout_s)
    manifests = sync.ask(lambda i, to: WorkspaceQuery(i, to, name, sync.sync_id))
    plans = {agent: _plan(local, manifests[agent].files) for agent in agents}
    for agent, (_, gone) in plans.items():
        if gone:
            runtime.send_message(agent, WorkspaceDelete(name, sync.sync_id, tuple(gone)))
    sync.send_files(tree, local, plans, _reporter(progress, plans, local))
    answers = sync.ask(lambda i, to: WorkspaceCommit(i, to, name, sync.sync_id))
    hosts = tuple(
        HostSync(agent, a.path, a.written, a.deleted, a.bytes_written)
        for agent, a in answers.items()
    )
    return WorkspaceSync(name, os.path.realpath(local_dir), hosts)


def _plan(
    local: dict[str, tuple[str, int, bool]], remote: tuple[FileEntry, ...]
) -> tuple[list[str], list[str]]:
    """(files to send, files to remove) to make a host's manifest `remote` equal `local`."""
    have = {path: (digest, size, exe) for path, digest, size, exe in remote}
    changed = sorted(path for path, entry in local.items() if have.get(path) != entry)
    return changed, sorted(set(have) - set(local))


class _Sync:
    """One sync's conversation with its agents: questions, pieces and acknowledgements."""

    def __init__(self, runtime: Runtime, agents: list[str], name: str, timeout_s: float) -> None:
        self.runtime = runtime
        self.agents = agents
        self.name = name
        self.timeout_s = timeout_s
        self.sync_id = secrets.token_hex(8)
        self._windows: dict[str, deque[tuple[int, Future[Any]]]] = {a: deque() for a in agents}
        self._unacknowledged = dict.fromkeys(agents, 0)

    def ask(self, request: Callable[[int, str], Any]) -> dict[str, Any]:
        """Send `request(request_id, reply_to)` to each agent; their answers by agent."""
        sent = {agent: self.runtime.queries.send(agent, request) for agent in self.agents}
        return {agent: self._answer(agent, future) for agent, (_, future) in sent.items()}

    def send_files(
        self,
        tree: dict[str, tuple[str, int, bool]],
        local: dict[str, tuple[str, int, bool]],
        plans: dict[str, tuple[list[str], list[str]]],
        report: Callable[[int, int], None],
    ) -> None:
        """Send each changed file, read once, to the agents that need it."""
        wanted: dict[str, list[str]] = {}
        for agent, (changed, _) in plans.items():
            for path in changed:
                wanted.setdefault(path, []).append(agent)
        for done, path in enumerate(sorted(wanted)):
            with open(tree[path][0], "rb") as file:
                self._send_file(file, path, local[path], wanted[path], partial(report, done))
            report(done + 1, 0)

    def _send_file(
        self,
        file: Any,
        path: str,
        entry: tuple[str, int, bool],
        agents: list[str],
        report: Callable[[int], None],
    ) -> None:
        """Send `file` (`path`, with the digest, size and executable bit of `entry`) in
        pieces; WorkspaceError if it changed size meanwhile."""
        digest, size, executable = entry
        offset = 0
        while True:
            data = file.read(min(CHUNK_BYTES, size - offset)) if offset < size else b""
            if offset < size and not data:
                raise WorkspaceError(f"file {path!r} shrank while it was synced; sync again")
            chunk = WorkspaceChunk(
                self.name, self.sync_id, path, offset, size, digest, executable, data
            )
            frames = encode(chunk)
            for agent in agents:
                self.runtime.send_frames(agent, WorkspaceChunk, frames)
                self._sent(agent, len(data))
            offset += len(data)
            report(len(data))
            if offset == size:
                return

    def _sent(self, agent: str, nbytes: int) -> None:
        """Count bytes sent to `agent`; past a window, ask for an acknowledgement, and wait
        for the one before it (two windows in flight at most)."""
        self._unacknowledged[agent] += nbytes
        if self._unacknowledged[agent] < WINDOW_BYTES:
            return
        self._unacknowledged[agent] = 0
        window = self._windows[agent]
        window.append(self.runtime.queries.send(agent, self._barrier))
        while len(window) > 1:
            self._answer(agent, window.popleft()[1])

    def _barrier(self, request_id: int, reply_to: str) -> WorkspaceBarrier:
        return WorkspaceBarrier(request_id, reply_to, self.name, self.sync_id)

    def _answer(self, agent: str, future: Future[Any]) -> Any:
        """The answer of `agent`; WorkspaceError if it refused or stayed silent."""
        try:
            answer = future.get(self.timeout_s)
        except TimeoutError:
            raise WorkspaceError(
                f"cannot sync workspace {self.name!r}: host agent {agent} did not answer within "
                f"{self.timeout_s:g} s; it is not running or not reachable from here"
            ) from None
        if answer.why:
            raise WorkspaceError(
                f"cannot sync workspace {self.name!r} to host agent {agent}: {answer.why}"
            )
        return answer


def _reporter(
    progress: bool | ProgressCallback,
    plans: dict[str, tuple[list[str], list[str]]],
    local: dict[str, tuple[str, int, bool]],
) -> Callable[[int, int], None]:
    """A function told (files done, bytes just sent) that passes progress on: to `progress`
    if it is a callable, as a line on stderr if it is True and the sync is large."""
    paths = {path for changed, _ in plans.values() for path in changed}
    total = sum(local[path][1] for path in paths)
    sent = [0, 0.0]

    def report(files: int, nbytes: int) -> None:
        sent[0] += nbytes
        state = SyncProgress(int(sent[0]), total, files, len(paths))
        if callable(progress):
            progress(state)
        elif progress and total >= PROGRESS_MIN_BYTES:
            now = time.monotonic()
            if now - sent[1] >= 0.5 or state.bytes_sent == total:
                sent[1] = now
                _print_line(state)

    return report


def _print_line(state: SyncProgress) -> None:
    mib = 1 << 20
    end = "\n" if state.bytes_sent == state.bytes_total else ""
    print(
        f"\rsyncing workspace: {state.bytes_sent / mib:.1f} of {state.bytes_total / mib:.1f} "
        f"MiB, {state.files_sent} of {state.files_total} files",
        end=end,
        file=sys.stderr,
        flush=True,
    )
