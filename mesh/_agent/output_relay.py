"""How the fork server relays its procs' stdout and stderr, line by line, never blocking: to
its own output with a ``[mesh point]`` prefix (the default), or, for the procs whose owner
asked (`ProcMesh.logging_option`), to the agent, which forwards the lines to that owner.

Output that cannot be written now (a reader that stopped reading, a busy agent) is dropped and
counted, with a notice once there is room again, so that relaying never keeps the fork server
from reaping procs.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import socket
import stat
from collections.abc import Callable
from typing import Any

from mesh._agent.log_files import RankLog
from mesh._engine.log_messages import OutputSynced, ProcOutput

#: The most bytes of lines one forwarded report carries (a longer line is cut in pieces).
_BATCH_BYTES = 32 * 1024
#: Reads of 64 KiB a sync makes at most per pipe: more than a pipe holds (64 KiB by default).
_DRAIN_READS = 16


def dropped_notice(count: int) -> bytes:
    return (
        f"[meshvisor] {count} bytes of proc output were dropped: nobody was reading this output"
    ).encode()


class Output:
    """One of the fork server's stdout/stderr, written without ever blocking: what a full pipe
    (a reader that stopped reading) cannot take is dropped and counted."""

    def __init__(self, fd: int) -> None:
        self.fd = _nonblocking_copy(fd)
        self.dropped = 0
        self._socket: socket.socket | None = None
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.fstat(fd).st_mode):  # e.g. the journal: send, never wait
                self._socket = socket.socket(fileno=os.dup(fd))
                self.fd = self._socket.fileno()

    def write(self, data: bytes) -> None:
        if self.dropped:
            if not self._write_all(dropped_notice(self.dropped) + b"\n"):
                self.dropped += len(data)
                return
            self.dropped = 0
        self._write_all(data)

    def _write_all(self, data: bytes) -> bool:
        """Write `data`; False (and the rest counted as dropped) when it does not fit now."""
        view = memoryview(data)
        while view:
            try:
                view = view[self._send(view) :]
            except (BlockingIOError, InterruptedError):
                self.dropped += len(view)
                return False
            except OSError:  # the output is gone (closed pipe): nothing to tell anyone
                return True
        return True

    def _send(self, data: memoryview) -> int:
        if self._socket is not None:
            return self._socket.send(data, socket.MSG_DONTWAIT)
        return os.write(self.fd, data)


def _nonblocking_copy(fd: int) -> int:
    """A non-blocking descriptor for what `fd` writes to (pipes, terminals), opened anew so
    that the client sharing `fd` keeps its blocking one; `fd` itself for regular files (they
    never block, and share the client's offset) and where no copy can be opened."""
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return fd


class Relay:
    """Copies one proc pipe (`stream` 1 or 2 of proc `proc_id`, owned by `owner`) line by
    line: to the proc's `log` file, and prefixed to `target`, or to the agent over
    `forward_to` while forwarding, or nowhere else while `quiet`."""

    def __init__(
        self, fd: int, target: Output, stream: int, config: dict[str, Any], prefix: str, pid: int
    ) -> None:
        self.fd, self.target, self.stream, self.partial = fd, target, stream, b""
        self.pid = pid
        os.set_blocking(fd, False)
        self.proc_id: str = config["proc_id"]
        self.owner: str = config["owner"]
        self.prefix = prefix
        self.forward_to: socket.socket | None = None
        self.log: RankLog | None = None
        self.quiet = False
        self.dropped = 0

    def pump(self) -> bool:
        """Copy what is available; False at end of file."""
        return self._copy_once() is not False

    def drain(self) -> bool:
        """Copy what was written so far (at most `_DRAIN_READS` reads: a proc that keeps
        printing must not hold the fork server); False at end of file."""
        for _ in range(_DRAIN_READS):
            copied = self._copy_once()
            if copied is not True:
                return copied is None
        return True

    def _copy_once(self) -> bool | None:
        """Copy one read: True if it read something, None if nothing is there now, False at
        end of file."""
        try:
            data = os.read(self.fd, 65536)
        except (BlockingIOError, InterruptedError):
            return None
        if not data:
            if self.partial:
                self._emit([self.partial])
            if self.log is not None:
                self.log.release()
            return False
        *lines, self.partial = (self.partial + data).split(b"\n")
        self._emit(lines)
        return True

    def _emit(self, lines: list[bytes]) -> None:
        if not lines:
            return
        if self.log is not None:
            self.log.write(self.stream, lines)
        if self.quiet and self.forward_to is None:
            return
        if self.forward_to is None:
            tag = f"[{self.prefix}] ".encode()
            self.target.write(b"".join(tag + line + b"\n" for line in lines))
            return
        if self.dropped and self._forward([dropped_notice(self.dropped)]):
            self.dropped = 0
        for batch in _batches(lines):
            if self.dropped or not self._forward(batch):
                self.dropped += sum(len(line) + 1 for line in batch)

    def _forward(self, lines: list[bytes]) -> bool:
        """Send `lines` to the agent now, or False (the agent is busy: they are dropped)."""
        assert self.forward_to is not None
        report = ("output", self.owner, self.proc_id, self.prefix, self.stream, lines)
        try:
            self.forward_to.send(pickle.dumps(report), socket.MSG_DONTWAIT)
        except OSError:
            return False
        return True


def drain_relays(selector: selectors.BaseSelector, which: Callable[[Relay], bool]) -> list[Relay]:
    """Copy what the procs of the relays `which` picks wrote so far (those at end of file are
    closed and unregistered); the others of them."""
    relays = [key.data for key in selector.get_map().values() if isinstance(key.data, Relay)]
    open_relays = []
    for relay in filter(which, relays):
        if relay.drain():
            open_relays.append(relay)
        else:
            selector.unregister(relay.fd)
            os.close(relay.fd)
    return open_relays


def open_log_files(selector: selectors.BaseSelector) -> list[int]:
    """The descriptors of the procs' open log files (a new proc closes them)."""
    relays = [key.data for key in selector.get_map().values() if isinstance(key.data, Relay)]
    return [relay.log.fd for relay in relays if relay.log is not None and relay.log.fd is not None]


def _batches(lines: list[bytes]) -> list[list[bytes]]:
    """`lines` in groups of at most `_BATCH_BYTES` (a longer line cut in pieces)."""
    batches: list[list[bytes]] = [[]]
    size = 0
    for line in lines:
        pieces = [line[i : i + _BATCH_BYTES] for i in range(0, len(line), _BATCH_BYTES)] or [b""]
        for piece in pieces:
            if size + len(piece) > _BATCH_BYTES and batches[-1]:
                batches.append([])
                size = 0
            batches[-1].append(piece)
            size += len(piece) + 1
    return batches


def forwarded_report(report: tuple[Any, ...]) -> tuple[str, object]:
    """The agent's side of an ``output`` or ``synced`` report of the fork server: to whom it
    goes, and as what message."""
    if report[0] == "synced":
        return report[1], OutputSynced(report[2])
    _, owner, proc_id, prefix, stream, lines = report
    text = tuple(line.decode("utf-8", "replace") for line in lines)
    return owner, ProcOutput(proc_id, prefix, stream, text)
