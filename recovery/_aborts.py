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

#: The longest wait for a connection to the group's store. A connection sometimes takes 5 s
#: with the store idle: torch's sockets look up the peer's name, and a DNS query the resolver
#: drops costs its timeout. The store is the controller's, which outlives every replica, so
#: this wait never hides a dead peer. Requests on the connection keep the group's timeout.
STORE_CONNECT_S = 30.0


def store_client(store: tuple[str, int], timeout_s: float) -> Any:
    """A connection of this process to the group's TCP store at `store`, whose requests time
    out after `timeout_s` (its connecting, after `STORE_CONNECT_S` at least)."""
    import torch.distributed as dist

    connect = datetime.timedelta(seconds=max(timeout_s, STORE_CONNECT_S))
    client = dist.TCPStore(  # type: ignore[attr-defined]
        store[0], store[1], is_master=False, timeout=connect
    )
    client.set_timeout(datetime.timedelta(seconds=timeout_s))
    return client


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
        self._store = store_client(store, timeout_s)
        self.quorum = -1

    def abort(self, quorum: int, reason: str) -> None:
        """Mark the process group of `quorum` aborted (its other participants stop waiting)."""
        self._store.set(abort_key(quorum), reason)

    def __call__(self) -> str | None:
        key = abort_key(self.quorum)
        if not self._store.check([key]):
            return None
        reason: bytes = self._store.get(key)
        return f"the process group of quorum {self.quorum} was aborted: " + reason.decode(
            errors="replace"
        )
