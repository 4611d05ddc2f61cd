"""`PayloadArena`: the host agent's half of the payload arena (see
`mesh/_engine/payload_arena.py`): one sealed memory file, mapped here read-write, cut into
slots that each hold one fanned-out call's payload until `free`.

Slots are taken first-fit from the lowest free offset, so a run of calls reuses the same warm
pages, which stay mapped in every proc: no page fault, no open, no mapping per call.
"""

from __future__ import annotations

import bisect
import fcntl
import mmap
import os

from mesh._engine.messages import CallActor
from mesh._engine.payload_arena import (
    ARENA_HEADER,
    ARENA_HEADER_BYTES,
    ARENA_NAME,
    ArenaCall,
    slot_bytes,
)
from mesh._engine.shared_payload import TOKEN, call_fields
from transport import Payload

#: The arena's size. Pages are only allocated when first written: an agent that shares
#: nothing costs nothing, and one that shares little costs its largest burst of payloads.
ARENA_BYTES = 64 << 20
_PAGE = mmap.PAGESIZE
_SEALS = getattr(fcntl, "F_SEAL_GROW", 4) | getattr(fcntl, "F_SEAL_SHRINK", 2)
_SEALS |= getattr(fcntl, "F_SEAL_SEAL", 1)


class PayloadArena:
    """One memory file of `capacity` bytes holding call payloads in slots."""

    def __init__(self, capacity: int = ARENA_BYTES) -> None:
        fd = os.memfd_create(ARENA_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(fd, 0o600)  # reachable only through /proc/<agent>/fd (same user) anyway
            os.ftruncate(fd, capacity)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            self._memory = mmap.mmap(fd, capacity)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._id = fd, os.fstat(fd).st_ino
        self._view = memoryview(self._memory)
        self._free = [(ARENA_HEADER_BYTES, capacity - ARENA_HEADER_BYTES)]  # (offset, size)
        self._used: dict[int, int] = {}  # offset -> size of the slots in use
        self._placed = 0

    def put(self, message: CallActor, payload: Payload) -> ArenaCall | None:
        """Write `payload` of call `message` into a free slot: the header that names it, or
        None when no slot is large enough now (the caller then shares it some other way). The
        slot's token is the call's id, which the caller never gives another call."""
        offset = self._take(slot_bytes(payload))
        if offset is None:
            return None
        token = TOKEN.pack(message.call_id)
        body = memoryview(payload.body).cast("B")
        buffers = [memoryview(b).cast("B") for b in payload.buffers]
        position = offset
        for part in (memoryview(token), body, *buffers):
            self._view[position : position + len(part)] = part
            position += len(part)
        self._placed += 1
        self._count()
        sizes = tuple(b.nbytes for b in buffers)
        call_id, reply_to, actor_id, endpoint, labels, mesh_sizes, rank = call_fields(message)
        return ArenaCall(
            call_id, reply_to, actor_id, endpoint, labels, mesh_sizes,
            os.getpid(), self._fd, self._id, offset, body.nbytes, sizes, rank,
        )  # fmt: skip

    def free(self, offset: int) -> None:
        """The slot at `offset` is no longer read by anyone: it may hold another payload."""
        size = self._used.pop(offset)
        index = bisect.bisect(self._free, (offset, size))
        self._free.insert(index, (offset, size))
        if index + 1 < len(self._free) and offset + size == self._free[index + 1][0]:
            size += self._free.pop(index + 1)[1]  # merge with the free range after it
            self._free[index] = (offset, size)
        if index > 0 and sum(self._free[index - 1]) == offset:
            before = self._free.pop(index - 1)  # and with the one before
            self._free[index - 1] = (before[0], before[1] + size)
        self._count()

    def _take(self, nbytes: int) -> int | None:
        """The offset of a free slot of at least `nbytes` (whole pages), now in use."""
        size = -(-nbytes // _PAGE) * _PAGE
        for index, (start, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[index]
                else:
                    self._free[index] = (start + size, length - size)
                self._used[start] = size
                return start
        return None

    def _count(self) -> None:
        used = sum(self._used.values())
        ARENA_HEADER.pack_into(self._memory, 0, used, len(self._used), self._placed)
