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
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mesh._engine.messages import CallActor, invalid_fields
from mesh._engine.replying import Replier
from supervision import ActorError
from transport import Envelope, Payload, get_logger, message_type, safe_str


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

_TOKEN_BYTES = 16
_IOV_MAX = 1024  # the most parts one writev takes (Linux's UIO_MAXIOV)
_SEALS = getattr(fcntl, "F_SEAL_WRITE", 8) | getattr(fcntl, "F_SEAL_GROW", 4)
_SEALS |= getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_SEAL", 1)


@message_type
@dataclass(frozen=True, slots=True)
class SharedCall:
    """Host agent → proc: `message`, whose payload lies in file descriptor `fd` of process
    `owner_pid` (a memory file): `token`, then the pickle body (`body_bytes`), then each
    out-of-band buffer (`buffer_bytes`), with no gaps."""

    message: CallActor
    owner_pid: int
    fd: int
    token: bytes
    body_bytes: int
    buffer_bytes: tuple[int, ...]


def can_share() -> bool:
    """Whether this system has sealable memory files (Linux)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")


def share_payload(message: CallActor, payload: Payload) -> tuple[int, SharedCall]:
    """Write `payload` into a new sealed memory file: (its fd, the header that names it). The
    caller owns the fd and closes it once no recipient will open it any more."""
    buffers = [memoryview(b).cast("B") for b in payload.buffers]
    body = memoryview(payload.body).cast("B")
    total = _TOKEN_BYTES + body.nbytes + sum(b.nbytes for b in buffers)
    token = secrets.token_bytes(_TOKEN_BYTES)
    fd = os.memfd_create("meshvisor-payload", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)  # reachable only through /proc/<agent>/fd (same user) anyway
        _write_all(fd, [token, body, *buffers], total)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    sizes = tuple(b.nbytes for b in buffers)
    return fd, SharedCall(message, os.getpid(), fd, token, body.nbytes, sizes)


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
    reason = invalid_fields(shared)  # the message too: a field of a message type
    if reason is None and (shared.body_bytes < 0 or any(n < 0 for n in shared.buffer_bytes)):
        reason = "negative sizes"
    if reason is not None:
        raise ValueError(f"a host agent sent a malformed SharedCall: {reason}")
    total = _TOKEN_BYTES + shared.body_bytes + sum(shared.buffer_bytes)
    path = f"/proc/{shared.owner_pid}/fd/{shared.fd}"
    fd = open_agent_file(path, "the shared payload")
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != total:
            raise ValueError(f"{path} is not the shared payload of {total} bytes it should be")
        view = memoryview(mmap.mmap(fd, total, access=mmap.ACCESS_COPY))
    finally:
        os.close(fd)
    if view[:_TOKEN_BYTES] != shared.token:
        raise ValueError(f"{path} is not the shared payload its header names (wrong token)")
    return Payload(*_split(view, shared.body_bytes, shared.buffer_bytes))


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
    start = _TOKEN_BYTES + body_bytes
    body, buffers = view[_TOKEN_BYTES:start], []
    for size in buffer_bytes:
        buffers.append(view[start : start + size])
        start += size
    return body, buffers
