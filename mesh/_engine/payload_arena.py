"""The payload arena: one memory file per host agent holding the large payloads of fanned-out
calls, which its procs map once and reuse (the agent's half is `mesh/_agent/payload_arena.py`).

A per-call memory file (`shared_payload.py`) costs each proc an open, a mapping and a page
fault per page touched; the arena costs it one copy, out of pages it has mapped already. A
slot holds one call's payload from the moment the agent writes it until every recipient has
answered or exited, so nothing in a proc may keep a view of it past its call: bytes,
bytearrays and tensors are rebuilt from read-only views as private copies (one copy each,
as a direct call's are), anything else gets a private, writable copy of its buffer.

Layout: a header page (`ARENA_HEADER`: bytes and slots in use, payloads placed so far; for
tests and tools), then slots, each a token (the id of the call it holds, `TOKEN`), the pickle
body, then each out-of-band buffer.

`ArenaCall` is flat and has a binary header: a proc reads one in about twenty Python calls
where a marshalled header nesting its `CallActor` took 250 (decoding and checking the nested
message), which cost each proc more than its copy of a 1 MB payload.
"""

from __future__ import annotations

import fcntl
import functools
import io
import mmap
import operator
import os
import pickle
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mesh._engine.messages import CallActor
from mesh._engine.shared_payload import (
    TOKEN,
    TOKEN_BYTES,
    bad_place,
    call_fields,
    check_agent_file,
    open_agent_file,
)
from transport import Payload, binary_header, loads, message_type

#: The name of the arena's memory file, as /proc/<pid>/fd and /proc/<pid>/maps show it.
ARENA_NAME = "meshvisor-arena"
#: The header page: three little-endian u64 counters, then nothing.
ARENA_HEADER = struct.Struct("<QQQ")
ARENA_HEADER_BYTES = 4096
#: A slot starts with its call's `TOKEN` (see `shared_payload`): an arena lives and dies with
#: its agent, so a stale header never finds its own id in a slot that holds another call's.
#: The largest payload an arena takes; larger ones get a memory file each, which procs map
#: without copying (a tensor of 64 MB is not copied at all).
ARENA_MAX_PAYLOAD = 16 << 20
#: The seals a proc needs before it maps an arena: it cannot shrink under a mapping (a read past
#: its end would kill the proc with SIGBUS) nor lose its seals.
_NEEDED_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_SEAL", 1)
_MAPS_KEPT = 4  # arenas of agents this proc heard from (one, but for a re-attached agent)


@binary_header(b"A")
@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class ArenaCall:
    """Host agent → proc: the `CallActor` of the first six fields and `rank`, whose payload
    lies at `offset` of the payload arena that is file descriptor `fd` of process
    `owner_pid` (inode `arena_id`): its token (`call_id`), then the pickle body
    (`body_bytes`), then each out-of-band buffer (`buffer_bytes`), with no gaps. The rank
    comes last: the agent encodes a call's header once and packs each proc's rank after it
    (`transport.prepare_header_but_last`)."""

    call_id: int
    reply_to: str | None
    actor_id: str
    endpoint: str
    labels: tuple[str, ...]
    sizes: tuple[int, ...]
    owner_pid: int
    fd: int
    arena_id: int
    offset: int
    body_bytes: int
    buffer_bytes: tuple[int, ...]
    rank: int

    @property
    def message(self) -> CallActor:
        """The call itself, as a proc runs it."""
        return CallActor(*call_fields(self))


_PLACE_FIELDS = operator.attrgetter("owner_pid", "fd", "arena_id", "offset", "body_bytes")


def slot_bytes(payload: Payload) -> int:
    """How many bytes of a slot `payload` fills (token included)."""
    return TOKEN_BYTES + payload.nbytes


def read_header(path: str) -> tuple[int, int, int]:
    """(bytes in use, slots in use, payloads placed so far) of the arena at `path`."""
    with open(path, "rb") as arena:
        return ARENA_HEADER.unpack(arena.read(ARENA_HEADER.size))  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class ArenaPayload(Payload):
    """A payload that lies in a payload arena, valid only until its call is answered."""

    def load(self) -> Any:
        """Unpickle, leaving no view of the arena behind (see `_ArenaUnpickler`). A body
        that did so before runs the same steps again: it is unpickled as it is, in C."""
        if not self.buffers:
            return loads(self.body)
        body = bytes(self.body) if len(self.body) <= _KNOWN_BODY_BYTES else None
        if body is not None and body in _KNOWN_BODIES:
            return loads(body, self.buffers)
        tally = _Tally()
        value = _ArenaUnpickler(self.body, self.buffers, tally).load()
        if tally.viewed == tally.copied:
            if body is not None and tally.trusted:
                _remember(body)
            return value
        del value  # a view went where no rebuilder copied it: rebuild from copies of our own
        return loads(bytes(self.body), [bytearray(buffer) for buffer in self.buffers])


#: Pickle bodies (of a few calls' argument shapes) whose every global is a copying rebuilder
#: and whose every buffer went to one: the same bytes do the same again, so they need no
#: checking unpickler (20 Python calls a call). The buffers are not in the body.
_KNOWN_BODIES: dict[bytes, None] = {}
_KNOWN_BODY_BYTES = 1024
_KNOWN_KEPT = 64


def _remember(body: bytes) -> None:
    if len(_KNOWN_BODIES) >= _KNOWN_KEPT:
        _KNOWN_BODIES.clear()
    _KNOWN_BODIES[body] = None


#: The rebuilders of out-of-band buffers that copy a read-only buffer (see transport._serialize).
_COPYING = frozenset(
    ("transport._serialize", name)
    for name in ("_rebuild_bytes", "_rebuild_bytearray", "_rebuild_tensor", "_rebuild_parameter")
)


class _Tally:
    """What an `_ArenaUnpickler` handed out: kept apart from it, so that no reference cycle
    holds the unpickler (and the values in its memo) alive after the call."""

    __slots__ = ("copied", "trusted", "viewed")

    def __init__(self) -> None:
        self.viewed = self.copied = 0  # views handed out, views the rebuilders took
        self.trusted = True  # no global but the copying rebuilders seen so far


class _ArenaUnpickler(pickle.Unpickler):
    """Hands out an out-of-band buffer as a read-only view of the arena only to the rebuilders
    that copy it (bytes, bytearray, tensors: one copy each, into this proc's own memory), and
    a private, writable copy to everything else (a numpy array, say, would keep a view):
    from the first global that is not one of them on, every buffer is a copy."""

    def __init__(self, body: Any, buffers: Sequence[Any], tally: _Tally) -> None:
        self._tally = tally
        super().__init__(io.BytesIO(body), buffers=_handed_out(buffers, tally))

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if (module, name) in _COPYING:
            return functools.partial(_counted, found, self._tally)
        self._tally.trusted = False
        return found


def _counted(rebuild: Callable[..., Any], tally: _Tally, buffer: Any, *args: Any) -> Any:
    tally.copied += isinstance(buffer, memoryview) and isinstance(buffer.obj, mmap.mmap)
    return rebuild(buffer, *args)


def _handed_out(sources: Sequence[Any], tally: _Tally) -> Iterator[Any]:
    for source in sources:  # asked for lazily, as each buffer is unpickled
        if tally.trusted:
            tally.viewed += 1
            yield source
        else:
            yield bytearray(source)


class ArenaMaps:
    """A proc's mappings of the payload arenas it was sent calls in: each mapped once."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int, int], memoryview] = {}
        self._lock = threading.Lock()  # calls arrive on the loop or on a receiver thread

    def payload(self, call: ArenaCall) -> Payload:
        """The payload `call` names, as views of the arena. Raises ValueError when the header
        is malformed or names no arena of this user, or a slot that is not this call's."""
        reason = bad_place(call.call_id, _PLACE_FIELDS(call), call.buffer_bytes)
        if reason is not None:
            raise ValueError(f"a host agent sent a malformed ArenaCall: {reason}")
        arena = self._arena(call)
        end = call.offset + TOKEN_BYTES + call.body_bytes + sum(call.buffer_bytes)
        if call.offset < ARENA_HEADER_BYTES or end > arena.nbytes:
            raise ValueError(
                f"an ArenaCall names bytes {call.offset} to {end} of a payload arena of "
                f"{arena.nbytes} bytes: outside its slots"
            )
        start = call.offset + TOKEN_BYTES
        if arena[call.offset : start] != TOKEN.pack(call.call_id):
            raise ValueError("the payload arena's slot holds another call's payload (wrong token)")
        body, buffers = arena[start : start + call.body_bytes], []
        start += call.body_bytes
        for size in call.buffer_bytes:
            buffers.append(arena[start : start + size])
            start += size
        return ArenaPayload(body, buffers)

    def _arena(self, call: ArenaCall) -> memoryview:
        key = (call.owner_pid, call.fd, call.arena_id)
        found = self._maps.get(key)
        if found is not None:
            return found
        with self._lock:
            if key not in self._maps:
                if len(self._maps) >= _MAPS_KEPT:  # the oldest: most likely a gone agent's
                    del self._maps[next(iter(self._maps))]
                self._maps[key] = _map_arena(*key)
            return self._maps[key]


def _map_arena(owner_pid: int, fd: int, arena_id: int) -> memoryview:
    """A read-only view of the whole arena, after checking it is one: the size comes from the
    file, never from a header, and the file must be private to this user and sealed."""
    path = f"/proc/{owner_pid}/fd/{fd}"
    opened = open_agent_file(path, "the payload arena")
    try:
        info = os.fstat(opened)
        check_agent_file(path, opened, info, ("a payload arena", arena_id, _NEEDED_SEALS))
        mapped = mmap.mmap(opened, info.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(opened)
    return memoryview(mapped)
