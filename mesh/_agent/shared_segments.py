"""`SharedSegments`: the host agent's memory files of shared call payloads, each kept open
until no recipient will open it any more (see `mesh/_engine/shared_payload.py`).

A proc opens the file when the call arrives, before it answers; so once every recipient has
answered or exited, the agent closes its descriptor, and the kernel frees the file when the
last proc unmaps it. The agent's exit, however it dies, closes every descriptor left.
"""

from __future__ import annotations

import os
from typing import Any

from mesh._engine.messages import CallActor, StopActor
from mesh._engine.shared_payload import (
    SHARED_PAYLOAD_MIN_BYTES,
    SharedCall,
    can_share,
    share_payload,
)
from transport import Payload

_SHARING = can_share()


class SharedSegments:
    """The open memory files by the relayed call they carry, with the recipients awaited."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self._open: dict[int, tuple[int, dict[int, str]]] = {}  # relay id -> fd, rank -> proc

    def share(
        self,
        relay_id: int,
        message: CallActor | StopActor,
        payload: Payload | None,
        recipients: int,
    ) -> SharedCall | None:
        """The header naming a memory file that holds `payload`, or None when the call is
        better copied to each proc (small, one recipient, no answers awaited) or sharing
        failed (then it is copied: the call must go on)."""
        if not isinstance(message, CallActor) or message.reply_to is None or payload is None:
            return None
        if not _SHARING or recipients < 2 or payload.nbytes < SHARED_PAYLOAD_MIN_BYTES:
            return None
        try:
            fd, shared = share_payload(message, payload)
        except OSError as exc:
            self._log.warning("payload_not_shared", reason=str(exc))
            return None
        self._open[relay_id] = (fd, {})
        return shared

    def expect(self, relay_id: int, rank: int, proc_id: str) -> None:
        """Rank `rank`, on `proc_id`, is sent the file of call `relay_id`."""
        self._open[relay_id][1][rank] = proc_id

    def sent(self, relay_id: int) -> None:
        """Every recipient of call `relay_id` has been sent it: close it if none was."""
        found = self._open.get(relay_id)
        if found is not None and not found[1]:
            self._close(relay_id)

    def answered(self, relay_id: int, rank: int) -> None:
        """Rank `rank` answered call `relay_id`: it has opened the file."""
        found = self._open.get(relay_id)
        if found is not None and found[1].pop(rank, None) is not None and not found[1]:
            self._close(relay_id)

    def proc_exited(self, proc_id: str) -> None:
        """`proc_id` exited: no file waits for it."""
        for relay_id, (_, waiting) in list(self._open.items()):
            for rank in [r for r, p in waiting.items() if p == proc_id]:
                del waiting[rank]
            if not waiting:
                self._close(relay_id)

    def _close(self, relay_id: int) -> None:
        os.close(self._open.pop(relay_id)[0])
