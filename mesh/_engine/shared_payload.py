"""Large call payloads shared by the procs of one host instead of copied to each of them.

A host agent that fans a call with a large payload out to several of its procs writes the
payload once into an anonymous, sealed memory file (`memfd_create`) and sends each proc a
`SharedCall` naming it; each proc maps the file through ``/proc/<agent pid>/fd/<fd>`` and
unpickles from the mapping. The file has no name in /dev/shm or anywhere else, so nothing can
leak: the kernel frees it once the agent has closed it (when every recipient has answered or
exited, or when the agent exits, however it dies) and the last proc has unmapped it.

Procs map it copy-on-write (MAP_PRIVATE) and the file is sealed against writes: tensors and
numpy arrays built on it are zero-copy and writable, and a proc that writes to one changes
only its own copy of the touched pages, never another proc's argument.

`SharedCall` is flat and has a binary header, as `ArenaCall` has: a proc reads one (and
unpickles a tensor) in about 45 Python calls where a marshalled header nesting its
`CallActor` took 230.
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import operator
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mesh._engine.messages import CallActor
from mesh._engine.replying import Replier
from supervision import ActorError
from transport import Envelope, Payload, binary_header, get_logger, message_type, safe_str


def open_agent_file(path: str, what: str) -> int:
    """A read-only descriptor of `path`, a host agent's file (``/proc/PID/fd/N``), opened
    without blocking (a stale number could name a pipe now); ValueError if it is gone."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"{what} {path} is gone: {exc.strerror}") from exc


#: The smallest payload a host agent shares rather than copies to each proc: below it, making
#: and mapping a memory file costs more than the copies it saves.
SHARED_PAYLOAD_MIN_BYTES = 1 << 20

#: A payload's token, first in its file: the id of the call it belongs to. The agent numbers
#: its relayed calls afresh for each (`FanOutRelay`), so a stale header never finds its own id
#: in a file that holds another call's payload.
TOKEN = struct.Struct("<q")
TOKEN_BYTES = TOKEN.size
_IOV_MAX = 1024  # the most parts one writev takes (Linux's UIO_MAXIOV)
#: The seals of a shared payload's file: nothing may change it once it is written.
SEALS = getattr(fcntl, "F_SEAL_WRITE", 8) | getattr(fcntl, "F_SEAL_GROW", 4)
SEALS |= getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_SEAL", 1)


@binary_header(b"S")
@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class SharedCall:
    """Host agent → proc: the `CallActor` of the fields it names, whose payload lies in file
    descriptor `fd` of process `owner_pid` (a memory file, inode `file_id`): its token
    (`call_id`), then the pickle body (`body_bytes`), then each out-of-band buffer
    (`buffer_bytes`), with no gaps. The ints that change from call to call lead: the rest of
    the header is encoded and decoded once per endpoint (see `transport._binary`); the rank
    comes last, packed by the agent after a header encoded once per call."""

    call_id: int
    owner_pid: int
    fd: int
    file_id: int
    reply_to: str | None
    actor_id: str
    endpoint: str
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    body_bytes: int
    buffer_bytes: tuple[int, ...]
    rank: int

    @property
    def message(self) -> CallActor:
        """The call itself, as a proc runs it."""
        return CallActor(*call_fields(self))


#: The fields of a `CallActor` (or of the one a `SharedCall` or `ArenaCall` holds), in order.
call_fields: Callable[[Any], tuple[Any, ...]] = operator.attrgetter(
    *(f.name for f in dataclasses.fields(CallActor))
)
_INT = {int}
_PLACE_FIELDS = operator.attrgetter("owner_pid", "fd", "file_id", "body_bytes")


def can_share() -> bool:
    """Whether this system has sealable memory files (Linux)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


def share_payload(message: CallActor, payload: Payload) -> tuple[int, SharedCall]:
    """Write `payload` into a new sealed memory file: (its fd, the header that names it). The
    caller owns the fd and closes it once no recipient will open it any more."""
    buffers = [memoryview(b).cast("B") for b in payload.buffers]
    body = memoryview(payload.body).cast("B")
    total = TOKEN_BYTES + body.nbytes + sum(b.nbytes for b in buffers)
    token = TOKEN.pack(message.call_id)
    fd = os.memfd_create("meshvisor-payload", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)  # reachable only through /proc/<agent>/fd (same user) anyway
        _write_all(fd, [token, body, *buffers], total)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        file_id = os.fstat(fd).st_ino
    except BaseException:
        os.close(fd)
        raise
    sizes = tuple(b.nbytes for b in buffers)
    call_id, reply_to, actor_id, endpoint, labels, mesh_sizes, rank = call_fields(message)
    return fd, SharedCall(
        call_id, os.getpid(), fd, file_id,
        reply_to, actor_id, endpoint, labels, mesh_sizes, body.nbytes, sizes, rank,
    )  # fmt: skip


def _write_all(fd: int, parts: list[Any], total: int) -> None:
    """Write `parts` (`total` bytes) at the start of `fd`, in as few system calls as the
    kernel allows: cheaper than faulting in a mapping of a new memory file page by page."""
    written = 0
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    while written < total:
        done = os.writev(fd, views[:_IOV_MAX])
        if done <= 0:
            raise OSError(f"writing the shared payload stopped after {written} of {total} bytes")
        written += done
        while views and done >= views[0].nbytes:
            done -= views.pop(0).nbytes
        if done:
            views[0] = views[0][done:]


def mapped_payload(shared: SharedCall) -> Payload:
    """The payload `shared` names, as views of a private mapping of the agent's memory file.
    Raises ValueError when the header is malformed or the file is not the one it names."""
    reason = bad_place(shared.call_id, _PLACE_FIELDS(shared), shared.buffer_bytes)
    if reason is not None:
        raise ValueError(f"a host agent sent a malformed SharedCall: {reason}")
    total = TOKEN_BYTES + shared.body_bytes + sum(shared.buffer_bytes)
    path = f"/proc/{shared.owner_pid}/fd/{shared.fd}"
    fd = open_agent_file(path, "the shared payload")
    try:
        info = os.fstat(fd)
        check_agent_file(path, fd, info, ("a shared payload", shared.file_id, SEALS))
        if info.st_size != total:
            raise ValueError(f"{path} is not the shared payload of {total} bytes it should be")
        view = memoryview(mmap.mmap(fd, total, access=mmap.ACCESS_COPY))
    finally:
        os.close(fd)
    if view[:TOKEN_BYTES] != TOKEN.pack(shared.call_id):
        raise ValueError(f"{path} is not the shared payload its header names (wrong token)")
    return Payload(*_split(view, shared.body_bytes, shared.buffer_bytes))


def bad_place(call_id: Any, numbers: tuple[Any, ...], sizes: Any) -> str | None:
    """Why the call id, `numbers` (where a payload lies) and buffer `sizes` of a header cannot
    be used, or None. (A binary header holds ints there; a marshalled one from a buggy agent
    might not.)"""
    values = (call_id, *numbers, *(sizes if type(sizes) is tuple else ("",)))
    if set(map(type, values)) != _INT:
        return "its call id, places and sizes must be ints"
    if min(values[1:]) < 0:
        return "a negative size, offset or id"
    if not 0 < call_id < 1 << 63:
        return f"call id {call_id} is no id an agent gives"
    return None


def check_agent_file(
    path: str, fd: int, info: os.stat_result, expected: tuple[str, int, int]
) -> None:
    """Raise ValueError unless `fd` (`path`, whose status is `info`) is what `expected` says:
    (what it is, its inode, its seals), a regular file private to this user: safe to map."""
    what, file_id, seals = expected
    private = info.st_uid == os.getuid() and not info.st_mode & 0o077
    if not stat.S_ISREG(info.st_mode) or info.st_ino != file_id or not private:
        raise ValueError(f"{path} is not {what} of this user (mode, owner, inode)")
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & seals != seals:
        raise ValueError(f"{path} is not sealed: it cannot be mapped safely")


def on_shared_call(
    read: Callable[[Any], Payload],
    deliver: Callable[[Envelope], None],
    replier: Replier,
    envelope: Envelope,
) -> None:
    """A proc's handler of `SharedCall` and `ArenaCall`: `deliver` the call with the payload
    that `read` finds for its header, or tell its caller why it cannot run (never a crash:
    the agent may have sent something stale)."""
    try:
        payload = read(envelope.header)
    except ValueError as exc:
        get_logger("mesh.actor").warning("shared_payload_unreadable", reason=safe_str(exc))
        message = getattr(envelope.header, "message", None)
        if isinstance(message, CallActor):
            replier.failure(message, "raised", ActorError(safe_str(exc)))
        return
    deliver(Envelope(envelope.header.message, payload))


def _split(view: memoryview, body_bytes: int, buffer_bytes: tuple[int, ...]) -> tuple[Any, Any]:
    """(body, buffers): the consecutive parts of `view` after the token."""
    start = TOKEN_BYTES + body_bytes
    body, buffers = view[TOKEN_BYTES:start], []
    for size in buffer_bytes:
        buffers.append(view[start : start + size])
        start += size
    return body, buffers
