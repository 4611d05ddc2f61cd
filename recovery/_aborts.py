"""Abort notices of a replica group's process groups, through the group's store.

The controller hears of a dead replica from supervision (at once for a death, after the
heartbeat timeout for a hang). It then marks the process group that replica belonged to as
aborted in the store; the survivors, waiting in a rendezvous or a collective, look for that
mark while they wait and give up on it, instead of waiting for gloo's timeout.
"""

from __future__ import annotations

from typing import Any

from transport import Addresses, get_logger


def store_client(store: Addresses, timeout_s: float) -> Any:
    """A connection of this process to the group's store at `store` (`_store_server`), whose
    requests time out after `timeout_s`."""
    from ._store_client import StoreClient

    return StoreClient(store, timeout_s)


def abort_key(quorum: int) -> str:
    """The store key that marks the process group of `quorum` as aborted."""
    return f"meshvisor-abort/{quorum}"


class AbortNotices:
    """The controller's side: marks process groups aborted in its store at `store` (from
    any thread)."""

    def __init__(self, store: Addresses, timeout_s: float) -> None:
        self._store = store_client(store, timeout_s)
        self._log = get_logger("recovery.aborts")

    def abort(self, quorum: int, reason: str) -> None:
        """Mark the group of `quorum` aborted; a notice that cannot be given (the group is
        closing) is logged: its participants then wait for their timeout."""
        try:
            self._store.set(abort_key(quorum), reason.encode())
        except Exception as exc:
            self._log.warning("abort_notice_lost", quorum=quorum, reason=str(exc))

    def close(self) -> None:
        self._store.close()


class AbortWatch:
    """A replica's side: whether the process group of `quorum` was aborted, and why. It has a
    store connection of its own, used only by the replica's thread that waits."""

    def __init__(self, store: Addresses, timeout_s: float) -> None:
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
