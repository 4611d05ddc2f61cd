"""`HandshakeWaits`: answers sent to a tcp caller whose connection had not passed its security
handshake yet, looked at again until it has, or until the caller refused it.

zmq takes a message for a tcp peer at once and keeps it while it connects. A caller that holds
other CURVE keys refuses every handshake, so the answer would wait in zmq forever, and the
caller with it. A refused answer is reported as one that could not be sent at all (the
`Replier` tells the actor's owner, `ReplyLost`), so that the call ends with an error saying why.
Past `MOST_WAITING` answers to one address, each is no longer kept: the owners they would be
reported to are, and each is told once that every answer to that address was refused (the
owner ends every call made there that waits on this proc): bounded, and no call is lost.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from transport import Outbox, TransportError, get_logger

#: How often the handshakes of waiting answers are looked at.
CHECK_INTERVAL_S = 0.25
#: How long an answer is watched at most: a caller that neither passes nor refuses a
#: handshake for this long is gone (its death is reported by other means).
GIVE_UP_AFTER_S = 60.0
#: The most answers watched one by one per caller address (a caller pipelining into a
#: refusal); past it, only their owners are kept.
MOST_WAITING = 10_000

#: What to do with an answer that its caller refused: told why.
Refused = Callable[[TransportError], None]
#: What to do when every answer to an address was refused: (the owner to tell, the address, why).
EveryRefused = Callable[[str, str, TransportError], None]


class _Watch:
    """The answers sent to one address: since when, each kept one by one, and past
    `most` of those, the owners of the others."""

    __slots__ = ("owners", "since", "waiting")

    def __init__(self, since: float) -> None:
        self.since = since
        self.waiting: list[Refused] = []
        self.owners: set[str] = set()


class HandshakeWaits:
    """The answers sent to callers whose handshake had not passed, by caller address."""

    def __init__(
        self,
        outbox: Outbox,
        call_soon: Callable[..., None],
        call_later: Callable[..., None],
        every_refused: EveryRefused,
        most: int = MOST_WAITING,
    ) -> None:
        self._outbox = outbox
        self._call_soon, self._call_later = call_soon, call_later
        self._every_refused, self._most = every_refused, most
        self._waiting: dict[str, _Watch] = {}
        self._lock = threading.Lock()
        self._scheduled = False

    def watch(self, address: str, refused: Refused, owner: str) -> None:
        """An answer went to `address`, whose handshake had not passed (any thread): call
        `refused` on the loop thread if `address` refuses this process's connection (past
        `most` answers, `every_refused` for `owner` instead, once)."""
        with self._lock:
            watch = self._waiting.get(address)
            if watch is None:
                watch = self._waiting[address] = _Watch(time.monotonic())
            if len(watch.waiting) < self._most:
                watch.waiting.append(refused)
            else:
                watch.owners.add(owner)
            start, self._scheduled = not self._scheduled, True
        if start:
            self._call_soon(self._call_later, CHECK_INTERVAL_S, self._check)

    def _check(self) -> None:
        """(loop thread) Report the answers whose caller refused them, forget those whose
        handshake passed, and look again later at the others."""
        now, refusals = time.monotonic(), []
        with self._lock:
            for address, watch in list(self._waiting.items()):
                reason = self._outbox.refusal(address)
                passed = reason is None and not self._outbox.unconfirmed(address)
                if reason is not None or passed or now - watch.since > GIVE_UP_AFTER_S:
                    del self._waiting[address]
                if reason is not None:
                    refusals.append((address, reason, watch))
            self._scheduled = bool(self._waiting)
        if self._scheduled:
            self._call_later(CHECK_INTERVAL_S, self._check)
        for address, reason, watch in refusals:
            self._report(address, reason, watch)

    def _report(self, address: str, reason: str, watch: _Watch) -> None:
        error = TransportError(
            f"{address} refused this process's connection: {reason}; the caller and this "
            "proc must hold the same allocation's CURVE keys"
        )
        tell = [functools.partial(refused, error) for refused in watch.waiting]
        tell += [functools.partial(self._every_refused, o, address, error) for o in watch.owners]
        for told in tell:
            try:
                told()
            except Exception as exc:  # the others must still be told
                log: Any = get_logger("mesh.replies")
                log.warning("reply_lost_unreported", to=address, reason=repr(exc))
