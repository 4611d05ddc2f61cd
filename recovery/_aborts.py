"""Abort notices of a replica group's process groups, through the group's TCP store.

The controller hears of a dead replica from supervision (at once for a death, after the
heartbeat timeout for a hang). It then marks the process group that replica belonged to as
aborted in the store; the survivors, waiting in a rendezvous or a collective, look for that
mark while they wait and give up on it, instead of waiting for gloo's timeout.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any


def abort_key(quorum: int) -> str:
    """The store key that marks the process group of `quorum` as aborted."""
    return f"meshvisor-abort/{quorum}"


class AbortNotices:
    """The controller's side: marks process groups aborted (from any thread)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()

    def abort(self, quorum: int, reason: str) -> None:
        with self._lock:
            self._store.set(abort_key(quorum), reason.encode())


class AbortWatch:
    """A replica's side: whether the process group of `quorum` was aborted, and why. It has a
    store connection of its own, used only by the replica's thread that waits."""

    def __init__(self, store: tuple[str, int], timeout_s: float) -> None:
        import torch.distributed as dist

        self._store = dist.TCPStore(  # type: ignore[attr-defined]
            store[0], store[1], is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self.quorum = -1

    def abort(self, quorum: int, reason: str) -> None:
        """Mark the process group of `quorum` aborted (its other participants stop waiting)."""
        self._store.set(abort_key(quorum), reason)

    def __call__(self) -> str | None:
        key = abort_key(self.quorum)
        if not self._store.check([key]):
            return None
        return f"the process group of quorum {self.quorum} was aborted: " + (
            self._store.get(key).decode(errors="replace")
        )
