"""Abort notices of a replica group's process groups, through the group's store.

The controller hears of a dead replica from supervision (at once for a death, after the
heartbeat timeout for a hang). It then marks the process group that replica belonged to as
aborted in the store; the survivors, waiting in a rendezvous or a collective, look for that
mark while they wait and give up on it, instead of waiting for gloo's timeout.

Every key of a quorum (its rendezvous, its abort notice) starts with its `quorum_prefix`, so
that the controller deletes them together once no one can need them (`QuorumKeys`): a long run
with many failures forms many groups, and the store holds 2^20 keys at most.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from transport import Addresses, get_logger


def store_client(store: Addresses, timeout_s: float) -> Any:
    """A connection of this process to the group's store at `store` (`_store_server`), whose
    requests time out after `timeout_s`."""
    from ._store_client import StoreClient

    return StoreClient(store, timeout_s)


def quorum_prefix(quorum: int) -> str:
    """What the store keys of `quorum`'s process group start with (then a slash)."""
    return f"quorum-{quorum}"


def abort_key(quorum: int) -> str:
    """The store key that marks the process group of `quorum` as aborted."""
    return f"{quorum_prefix(quorum)}/meshvisor-abort"


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

    def forget(self, quorums: Collection[int]) -> None:
        """Delete every key of `quorums` (a deletion that fails is logged: keys stay)."""
        if not quorums:
            return
        try:
            self._store.delete_prefixes([f"{quorum_prefix(quorum)}/" for quorum in quorums])
        except Exception as exc:
            self._log.warning("quorum_keys_kept", quorums=sorted(quorums), reason=str(exc))

    def close(self) -> None:
        self._store.close()


class QuorumKeys:
    """Which quorums' keys can go, told each time a group forms: once the group of quorum Q
    formed (every member joined it), its members have left every older group, and a member
    that is not in it failed. So the keys of every quorum before Q go then, but those of the
    groups still `in_use` (standing groups formed in advance), which go at a later formation.
    Each deletion is made again at the next formation, for a key written late (an abort
    notice given just after, an abandoned rendezvous of a dead member ending)."""

    def __init__(self, notices: AbortNotices) -> None:
        self._notices = notices
        self._latest = 0  # the quorum formed last; those before it are forgotten or `_kept`
        self._kept: set[int] = set()
        self._last: set[int] = set()

    def formed(self, quorum: int, in_use: Collection[int]) -> None:
        """The group of `quorum` formed; `in_use`: the quorums of other groups still used."""
        if quorum <= self._latest:
            return  # (told again, or an older standing group taken: nothing new to forget)
        old = self._kept | set(range(max(self._latest, 1), quorum))
        self._latest = quorum
        self._kept = {q for q in old if q in in_use}
        forgotten = old - self._kept
        self._notices.forget(forgotten | self._last)
        self._last = forgotten


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
