"""Stopping what a `ReplicaGroup` started: its replicas, its spares, its abort notices and its
store. Its `close` does it, and so does a constructor that raises halfway (a spawn refused, an
argument that cannot be sent), so that nothing it started outlives it."""

from __future__ import annotations

from collections.abc import Sequence

from ._aborts import AbortNotices
from ._members import Member
from ._standby import Standbys
from ._store_server import StoreServer

#: How long the replicas' procs have to end after they are asked to, and how long it is waited.
GRACE_S = 1.0
STOP_WAIT_S = 10.0


def stop_group(
    members: Sequence[Member],
    store: StoreServer,
    standbys: Standbys | None = None,
    notices: AbortNotices | None = None,
) -> None:
    """Stop every replica of `members` (none is re-spawned from now on) and every spare, then
    close the abort notices and the store (what was not made yet is None)."""
    for member in members:
        with member.lock:  # neither a failure nor a re-spawn from now on
            member.state = "closed"
    stopping = [member.procs.stop(grace_s=GRACE_S) for member in members]
    if standbys is not None:
        standbys.close()
    for future in stopping:
        try:
            future.get(timeout=STOP_WAIT_S)
        except Exception:
            pass
    if notices is not None:
        notices.close()
    store.close()
