"""`RelayHandshakes`: answers the host agent sent on to a tcp caller whose connection had not
passed its security handshake, looked at again until it has, or until the caller refused it.

zmq takes a message for a tcp peer at once and keeps it while it connects; a caller holding
other CURVE keys than the agent refuses every handshake, so the answers of its fanned-out
call would wait in zmq forever, and the call for its timeout. A refusal is reported as
answers that could not be sent (`FanOutRelay._lost`: each proc's owner ends the call). Past
`MOST_WAITING` answers to one address, only the (owner, proc) pairs are kept, each told once
that every answer to that address was refused: bounded, and no call is left waiting.
The agent is a single-threaded loop: `check` runs on its passes, `due_in` bounds its wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from transport import Outbox, TransportError

#: How often the handshakes of waiting answers are looked at.
CHECK_INTERVAL_S = 0.25
#: How long answers are watched at most: a caller that neither passes nor refuses a
#: handshake for this long is gone (its calls end by other means).
GIVE_UP_AFTER_S = 60.0
#: The most sends watched one by one per caller address.
MOST_WAITING = 10_000

#: What to do with answers that their caller refused: told why.
Refused = Callable[[TransportError], None]
#: Every answer to an address was refused: (the owner to tell, the proc, the address, why).
EveryRefused = Callable[[str, str, str, TransportError], None]


class _Watch:
    __slots__ = ("owners", "since", "waiting")

    def __init__(self, since: float) -> None:
        self.since = since
        self.waiting: list[Refused] = []
        self.owners: set[tuple[str, str]] = set()  # (owner, proc id), past `most`


class RelayHandshakes:
    """The answers sent on to callers whose handshake had not passed, by caller address."""

    def __init__(
        self, outbox: Outbox, every_refused: EveryRefused, most: int = MOST_WAITING
    ) -> None:
        self._outbox = outbox
        self._every_refused = every_refused
        self._most = most
        self.waiting: dict[str, _Watch] = {}  # read-only outside: is anything watched
        self._next_check = 0.0

    def watch(
        self, address: str, refused: Refused, owners: Callable[[], Iterable[tuple[str, str]]]
    ) -> None:
        """Answers went to `address`, whose handshake had not passed: call `refused` if it
        refuses the agent (past `most`, `every_refused` once for each of `owners()`)."""
        watch = self.waiting.get(address)
        if watch is None:
            if not self.waiting:
                self._next_check = time.monotonic() + CHECK_INTERVAL_S
            watch = self.waiting[address] = _Watch(time.monotonic())
        if len(watch.waiting) < self._most:
            watch.waiting.append(refused)
        else:
            watch.owners.update(owners())

    def due_in(self, longest: float) -> float:
        """Seconds until the next look at the handshakes, at most `longest`."""
        if not self.waiting:
            return longest
        return max(0.0, min(longest, self._next_check - time.monotonic()))

    def check(self) -> None:
        """Report the answers whose caller refused them, forget those whose handshake passed
        (or that waited past `GIVE_UP_AFTER_S`); at most once per `CHECK_INTERVAL_S`."""
        if not self.waiting:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL_S
        for address, watch in list(self.waiting.items()):
            reason = self._outbox.refusal(address)
            passed = reason is None and not self._outbox.unconfirmed(address)
            if reason is not None or passed or now - watch.since > GIVE_UP_AFTER_S:
                del self.waiting[address]
            if reason is not None:
                self._report(address, reason, watch)

    def _report(self, address: str, reason: str, watch: _Watch) -> None:
        error = TransportError(
            f"{address} refused this host agent's connection: {reason}; the caller and the "
            "host agent must hold the same allocation's CURVE keys"
        )
        for refused in watch.waiting:
            refused(error)
        for owner, proc_id in sorted(watch.owners):
            self._every_refused(owner, proc_id, address, error)
