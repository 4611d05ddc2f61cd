"""The messages of workspace sync: a client copies a local directory to its host agents.

Client → agent: WorkspaceQuery (answered by WorkspaceManifest: the files the agent has),
WorkspaceDelete, WorkspaceChunk (pieces of changed files, in order), WorkspaceBarrier
(answered by WorkspaceProgress once every piece before it is written: the client's flow
control) and WorkspaceCommit (answered by WorkspaceSynced: what this sync wrote and removed).
Every field is a plain value: file data travels as bytes in headers, never pickled.
"""

from __future__ import annotations

from dataclasses import dataclass

from transport import message_type

#: One file of a manifest: (relative posix path, sha256 hex digest, size in bytes, executable).
FileEntry = tuple[str, str, int, bool]


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class WorkspaceQuery:
    """Client → agent: send the manifest of workspace `name` to `reply_to`; a new sync
    `sync_id` starts (pieces of an earlier, unfinished one are dropped)."""

    request_id: int
    reply_to: str
    name: str
    sync_id: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class WorkspaceManifest:
    """Agent → client: the files of workspace `name` (`why`: why it refused, "" if not)."""

    request_id: int
    agent: str
    name: str
    files: tuple[FileEntry, ...]
    why: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class WorkspaceDelete:
    """Client → agent: remove `paths` from workspace `name` (before new files arrive)."""

    name: str
    sync_id: str
    paths: tuple[str, ...]


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class WorkspaceChunk:
    """Client → agent: bytes `offset`.. of file `path` (`size` bytes in all, digest `sha256`);
    the last piece makes the agent check the digest and move the file into place."""

    name: str
    sync_id: str
    path: str
    offset: int
    size: int
    sha256: str
    executable: bool
    data: bytes


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class WorkspaceBarrier:
    """Client → agent: answer a `WorkspaceProgress` once everything sent before is written."""

    request_id: int
    reply_to: str
    name: str
    sync_id: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class WorkspaceProgress:
    """Agent → client: bytes of sync `request_id` written so far; `why`: what went wrong."""

    request_id: int
    agent: str
    bytes_written: int
    why: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class WorkspaceCommit:
    """Client → agent: the sync is complete; answer what it wrote and removed."""

    request_id: int
    reply_to: str
    name: str
    sync_id: str


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class WorkspaceSynced:
    """Agent → client: sync `request_id` is done: the workspace's directory on that host, the
    files written and removed, bytes received; `why` says what failed ("" if nothing)."""

    request_id: int
    agent: str
    path: str
    written: tuple[str, ...]
    deleted: tuple[str, ...]
    bytes_written: int
    why: str


#: The agent's answers (each carries the `request_id` it answers).
WORKSPACE_ANSWERS = (WorkspaceManifest, WorkspaceProgress, WorkspaceSynced)
