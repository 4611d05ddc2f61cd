"""`DetachedMesh`: one detached mesh as a host agent keeps it: its owner (and how to tell it
is gone), the failures kept for an adopter, and those sent lately to its owner."""

from __future__ import annotations

import os
import select
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from mesh._engine.messages import ProcExited
from transport import Payload

#: Failures kept per detached mesh while nobody owns it; beyond, the oldest are dropped.
KEPT_LIMIT = 1000

Kept = tuple[Any, Payload | None]


@dataclass
class DetachedMesh:
    """One detached mesh as this agent keeps it."""

    name: str
    agents: tuple[str, ...]
    spec: bytes
    ttl_s: float
    owner: str | None
    owner_pid: int
    owner_fd: int | None
    owner_since: float  # monotonic: when the owner registered or claimed it
    unowned_since: float = 0.0  # unix time; 0 while owned
    unowned_at: float = 0.0  # monotonic
    pending: bool = False  # claimed; failures wait for ClaimDone
    stopping: bool = False
    actors: dict[str, bytes] = field(default_factory=dict)
    kept: deque[Kept] = field(default_factory=lambda: deque(maxlen=KEPT_LIMIT))
    kept_procs: set[str] = field(default_factory=set)
    recent: deque[tuple[float, Any, Payload | None]] = field(default_factory=deque)

    def set_owner(self, owner: str | None, pid: int, local: bool, now: float) -> None:
        """`owner` (None: nobody) owns it from `now`; a `local` one is watched by its pid."""
        if self.owner_fd is not None:
            os.close(self.owner_fd)
        self.owner, self.owner_pid, self.owner_since = owner, pid, now
        self.owner_fd = _pidfd(pid) if owner is not None and local else None

    def owner_alive(self, last_seen: float | None, timeout_s: float, now: float) -> bool:
        """Whether its owner lives: a local one's process, else a sign of life (`last_seen`,
        or the claim) within `timeout_s`."""
        if self.owner_fd is not None:
            return not select.select([self.owner_fd], [], [], 0)[0]
        return max(last_seen or 0.0, self.owner_since) > now - timeout_s

    def owner_words(self) -> str:
        if self.owner is None:
            since = time.strftime("%H:%M:%S", time.localtime(self.unowned_since))
            return f"unowned since {since}"
        return f"owned by the client at {self.owner}, pid {self.owner_pid}"

    def keep(self, header: Any, payload: Payload | None) -> bool:
        """Keep a failure for the adopter; True if the oldest was dropped to make room."""
        full = len(self.kept) == self.kept.maxlen
        self.kept.append((header, payload))
        if type(header) is ProcExited:
            self.kept_procs.add(header.proc_id)
        return full

    def take_kept(self) -> list[Kept]:
        """The kept failures, oldest first; none are kept any more."""
        kept = list(self.kept)
        self.kept.clear()
        self.kept_procs.clear()
        return kept

    def forget_recent(self, before: float) -> None:
        """Forget the failures sent to the owner before monotonic time `before`."""
        while self.recent and self.recent[0][0] < before:
            self.recent.popleft()


def _pidfd(pid: int) -> int | None:
    """A pidfd of a local owner, to see it gone at once; None if it cannot be had."""
    try:
        return os.pidfd_open(pid) if pid > 0 else None
    except OSError:
        return None
