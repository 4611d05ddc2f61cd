"""Fault hooks: rules that make this process drop or delay what it sends to chosen addresses.

The chaos harness installs them (here, and in other processes through a message) to break
the network deterministically: each rule draws from its own seeded generator, one draw per
message, so the same traffic meets the same drops. Rules expire on their own. With no rule
installed, `Outbox.send` pays one attribute test.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._frames import message_type


@message_type  # SetFaultRules carries rules in its header
@dataclass(frozen=True)
class FaultRule:
    """Drop (with `probability`) or delay (by `delay_s`) messages this process sends to any of
    the addresses `to`, for `duration_s` seconds from the moment the rule is installed.

    With `hold`, messages are held until the rule ends and then leave in order: a link cut
    for a while, as TCP would carry the queued data once it is back.
    """

    to: frozenset[str]
    duration_s: float
    probability: float = 0.0
    delay_s: float = 0.0
    seed: int = 0
    label: str = ""
    hold: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"a drop probability must be within [0, 1], not {self.probability}")
        if self.duration_s < 0 or self.delay_s < 0:
            raise ValueError("a fault rule's duration and delay cannot be negative")


@dataclass
class _Active:
    rule: FaultRule
    until: float
    draws: random.Random = field(repr=False)


SendNow = Callable[[str, Sequence[Any]], None]


class NetworkFaults:
    """The fault rules of this process, consulted for every message it sends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[_Active] = []
        self.active = False  # the fast path: no rule, nothing to decide
        self._line: _DelayLine | None = None
        self.dropped = 0
        self.delayed = 0

    def install(self, rules: Iterable[FaultRule]) -> None:
        """Add `rules`; each lasts its `duration_s` from now."""
        now = time.monotonic()
        with self._lock:
            for rule in rules:
                active = _Active(rule, now + rule.duration_s, random.Random(rule.seed))
                self._rules.append(active)
            self._refresh()

    def clear(self) -> None:
        """Remove every rule at once (messages already delayed still leave in order)."""
        with self._lock:
            self._rules = []
            self._refresh()

    def _refresh(self) -> None:
        """Rules, or delayed messages still waiting, keep every send on the slow path: a
        message must not overtake one delayed before it (call with the lock held)."""
        self.active = bool(self._rules) or (self._line is not None and self._line.busy())

    def _line_emptied(self) -> None:
        with self._lock:
            self._refresh()

    def rules(self) -> list[FaultRule]:
        with self._lock:
            return [a.rule for a in self._rules]

    def route(self, address: str, frames: Sequence[Any], send_now: SendNow) -> None:
        """Send `frames` to `address` through the rules: drop, delay, or send at once."""
        delay = self._decide(address)
        if delay is None:
            self.dropped += 1
            return
        line = self._line
        if delay > 0 or (line is not None and line.holds(address)):
            self.delayed += delay > 0
            line = self._delay_line()
            line.push(address, _snapshot(frames), delay, send_now)
            with self._lock:
                self._refresh()
            return
        send_now(address, frames)

    def _decide(self, address: str) -> float | None:
        """The delay for one message to `address`, or None to drop it."""
        now = time.monotonic()
        delay = 0.0
        with self._lock:
            live = [a for a in self._rules if a.until > now]
            if len(live) != len(self._rules):
                self._rules = live
                self._refresh()
            for active in live:
                rule = active.rule
                if address not in rule.to:
                    continue
                if rule.probability and active.draws.random() < rule.probability:
                    return None
                delay = max(delay, rule.delay_s, active.until - now if rule.hold else 0.0)
        return delay

    def _delay_line(self) -> _DelayLine:
        with self._lock:
            if self._line is None:
                self._line = _DelayLine(self._line_emptied)
            return self._line


class _DelayLine:
    """A thread that sends delayed messages when they are due, keeping each destination's
    order (a message never overtakes one sent before it to the same address)."""

    def __init__(self, on_empty: Callable[[], None]) -> None:
        self._heap: list[tuple[float, int, str, Sequence[Any], SendNow]] = []
        self._last_due: dict[str, float] = {}
        self._pending: dict[str, int] = {}  # messages not sent yet, per address
        self._on_empty = on_empty
        self._order = itertools.count()
        self._wake = threading.Condition()
        threading.Thread(target=self._run, name="meshvisor-delay-line", daemon=True).start()

    def holds(self, address: str) -> bool:
        """Whether a message to `address` is still waiting here (a new one must queue)."""
        with self._wake:
            return self._pending.get(address, 0) > 0

    def busy(self) -> bool:
        with self._wake:
            return bool(self._pending)

    def push(self, address: str, frames: Sequence[Any], delay_s: float, send_now: SendNow) -> None:
        with self._wake:
            due = max(time.monotonic() + delay_s, self._last_due.get(address, 0.0))
            self._last_due[address] = due
            self._pending[address] = self._pending.get(address, 0) + 1
            heapq.heappush(self._heap, (due, next(self._order), address, frames, send_now))
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._wake.wait(timeout)
                _, _, address, frames, send_now = heapq.heappop(self._heap)
            try:
                send_now(address, frames)
            except Exception:  # the destination went away meanwhile: as if lost on the wire
                pass
            with self._wake:
                self._pending[address] -= 1
                if not self._pending[address]:
                    del self._pending[address]
                emptied = not self._pending
            if emptied:
                self._on_empty()


def _snapshot(frames: Sequence[Any]) -> list[bytes]:
    """Copies of `frames`: the caller may change its buffers once send() returns."""
    return [bytes(frame) for frame in frames]


_FAULTS = NetworkFaults()


def network_faults() -> NetworkFaults:
    """This process's fault rules (shared by every outbox of the process)."""
    return _FAULTS
