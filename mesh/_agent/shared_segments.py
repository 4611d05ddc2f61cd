"""`SharedSegments`: where the host agent keeps the large payloads of fanned-out calls, each
until no recipient will read it any more: a slot of its payload arena
(`mesh/_agent/payload_arena.py`) for most, a memory file of its own for the largest
(`mesh/_engine/shared_payload.py`).

A proc reads its payload when the call arrives, before it answers; so once every recipient has
answered or exited, the agent frees the slot or closes the file (the kernel frees the file
when the last proc unmaps it). The agent's exit, however it dies, closes every descriptor.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any

from mesh._agent.payload_arena import PayloadArena
from mesh._engine.messages import CallActor, StopActor
from mesh._engine.payload_arena import ARENA_MAX_PAYLOAD, ArenaCall
from mesh._engine.shared_payload import (
    SHARED_PAYLOAD_MIN_BYTES,
    SharedCall,
    can_share,
    share_payload,
)
from transport import Payload

_SHARING = can_share()
#: Names in a pickle body of the rebuilders of tensors and numpy arrays, which map a memory
#: file of the call without copying it; the arena would copy them (a routing hint only: the
#: agent never unpickles, and either way the proc gets the same value).
_ZERO_COPY_REBUILDERS = re.compile(rb"_rebuild_tensor|_rebuild_parameter|_frombuffer")


class SharedSegments:
    """The shared payloads by the relayed call they carry, with the recipients awaited."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self._open: dict[int, tuple[Callable[[], None], dict[int, str]]] = {}  # relay id ->
        # how to let it go, rank -> proc
        self._arena: PayloadArena | None = None
        self._arena_failed = False

    def share(
        self,
        relay_id: int,
        message: CallActor | StopActor,
        payload: Payload | None,
        recipients: int,
    ) -> SharedCall | ArenaCall | None:
        """The header naming where `payload` lies, or None when the call is better copied to
        each proc (small, one recipient, no answers awaited) or sharing failed (then it is
        copied: the call must go on)."""
        if not isinstance(message, CallActor) or message.reply_to is None or payload is None:
            return None
        if not _SHARING or recipients < 2 or payload.nbytes < SHARED_PAYLOAD_MIN_BYTES:
            return None
        placed = self._in_arena(message, payload)
        if placed is not None:
            self._open[relay_id] = (functools.partial(self._free, placed.offset), {})
            return placed
        try:
            fd, shared = share_payload(message, payload)
        except OSError as exc:
            self._log.warning("payload_not_shared", reason=str(exc))
            return None
        self._open[relay_id] = (functools.partial(os.close, fd), {})
        return shared

    def _in_arena(self, message: CallActor, payload: Payload) -> ArenaCall | None:
        """`payload` written into the arena (made on first use), or None: too large, holding
        tensors or arrays (not copied from a file of their own), no room left now, or no
        arena to be had."""
        if payload.nbytes > ARENA_MAX_PAYLOAD or self._arena_failed:
            return None
        if _ZERO_COPY_REBUILDERS.search(payload.body):  # any bytes-like body, without a copy
            return None
        if self._arena is None:
            try:
                self._arena = PayloadArena()
            except OSError as exc:
                self._arena_failed = True
                self._log.warning("payload_arena_unavailable", reason=str(exc))
                return None
        return self._arena.put(message, payload)

    def _free(self, offset: int) -> None:
        assert self._arena is not None  # a slot was taken from it
        self._arena.free(offset)

    def expect(self, relay_id: int, rank: int, proc_id: str) -> None:
        """Rank `rank`, on `proc_id`, is sent the payload of call `relay_id`."""
        self._open[relay_id][1][rank] = proc_id

    def sent(self, relay_id: int) -> None:
        """Every recipient of call `relay_id` has been sent it: let it go if none was."""
        found = self._open.get(relay_id)
        if found is not None and not found[1]:
            self._release(relay_id)

    def answered(self, relay_id: int, rank: int) -> None:
        """Rank `rank` answered call `relay_id`: it has read the payload."""
        found = self._open.get(relay_id)
        if found is not None and found[1].pop(rank, None) is not None and not found[1]:
            self._release(relay_id)

    def proc_exited(self, proc_id: str) -> None:
        """`proc_id` exited: no payload waits for it."""
        for relay_id, (_, waiting) in list(self._open.items()):
            for rank in [r for r, p in waiting.items() if p == proc_id]:
                del waiting[rank]
            if not waiting:
                self._release(relay_id)

    def _release(self, relay_id: int) -> None:
        self._open.pop(relay_id)[0]()
