"""Restart policies in the OTP tradition, as values: what to restart, how often, how soon.

`RestartPolicy` says it; `RestartTracker` applies it to a stream of failures on a clock (a real
one in production, a fake one in tests) and answers each failure with a `RestartDecision`:
which ranks to restart and after what delay, or escalate because the intensity was exceeded.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Strategy = Literal["one_for_one", "one_for_all", "rest_for_one"]
RestartType = Literal["permanent", "transient", "temporary"]
STRATEGIES: tuple[str, ...] = ("one_for_one", "one_for_all", "rest_for_one")
RESTART_TYPES: tuple[str, ...] = ("permanent", "transient", "temporary")


@dataclass(frozen=True)
class RestartPolicy:
    """How a mesh's failed ranks come back.

    - `strategy`: ``one_for_one`` restarts the failed rank; ``one_for_all`` every rank;
      ``rest_for_one`` the failed rank and every rank after it.
    - `restart`: ``permanent`` always restarts; ``transient`` only after a failure (not after
      a clean exit with code 0); ``temporary`` never restarts.
    - at most `max_restarts` restarts within `within_s` seconds, else the failure escalates.
    - the n-th consecutive restart waits ``min(backoff_max_s, backoff_s * 2**(n-1))``,
      spread by up to `jitter` of itself.
    """

    strategy: Strategy = "one_for_one"
    restart: RestartType = "permanent"
    max_restarts: int = 3
    within_s: float = 5.0
    backoff_s: float = 0.0
    backoff_max_s: float = 10.0
    jitter: float = 0.1

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"unknown restart strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}"
            )
        if self.restart not in RESTART_TYPES:
            raise ValueError(
                f"unknown restart type {self.restart!r}; use one of {', '.join(RESTART_TYPES)}"
            )
        if self.max_restarts < 0 or self.within_s <= 0:
            raise ValueError(
                "max_restarts must be >= 0 and within_s > 0, got "
                f"{self.max_restarts} and {self.within_s}"
            )
        if self.backoff_s < 0 or self.backoff_max_s < self.backoff_s or not 0 <= self.jitter <= 1:
            raise ValueError(
                "need 0 <= backoff_s <= backoff_max_s and 0 <= jitter <= 1, got "
                f"{self.backoff_s}, {self.backoff_max_s}, {self.jitter}"
            )

    def backoff(self, attempt: int, rng: random.Random) -> float:
        """The delay before restart number `attempt` (1-based) of a burst."""
        if self.backoff_s == 0:
            return 0.0
        base: float = min(self.backoff_max_s, self.backoff_s * 2.0 ** (attempt - 1))
        return base * (1 + self.jitter * (2 * rng.random() - 1))

    def ranks_to_restart(self, failed: int, size: int) -> tuple[int, ...]:
        """Which ranks (row-major indices of a mesh of `size`) restart after `failed` fails."""
        if self.strategy == "one_for_one":
            return (failed,)
        if self.strategy == "one_for_all":
            return tuple(range(size))
        return tuple(range(failed, size))

    def wants_restart(self, clean_exit: bool) -> bool:
        """Whether this kind of ending calls for a restart at all."""
        if self.restart == "temporary":
            return False
        return not (self.restart == "transient" and clean_exit)


@dataclass(frozen=True)
class RestartDecision:
    """What to do about one failure: restart `ranks` after `delay_s`, or escalate (`ranks`
    empty) with `reason`."""

    ranks: tuple[int, ...]
    delay_s: float = 0.0
    attempt: int = 0
    reason: str = ""

    @property
    def escalate(self) -> bool:
        return not self.ranks


@dataclass
class RestartTracker:
    """Applies a `RestartPolicy` to the failures of one mesh of `size` ranks."""

    policy: RestartPolicy
    size: int
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    _recent: deque[float] = field(default_factory=deque, init=False)
    _streak: int = field(default=0, init=False)

    def on_failure(self, rank: int, *, clean_exit: bool = False) -> RestartDecision:
        """Record that `rank` ended and decide what follows."""
        if not self.policy.wants_restart(clean_exit):
            return RestartDecision(
                (), reason=f"restart type {self.policy.restart!r} does not restart this ending"
            )
        now = self.clock()
        while self._recent and now - self._recent[0] > self.policy.within_s:
            self._recent.popleft()
        if not self._recent:
            self._streak = 0
        if len(self._recent) >= self.policy.max_restarts:
            return RestartDecision(
                (),
                reason=(
                    f"more than {self.policy.max_restarts} restarts within {self.policy.within_s} s"
                ),
            )
        self._recent.append(now)
        self._streak += 1
        return RestartDecision(
            self.policy.ranks_to_restart(rank, self.size),
            self.policy.backoff(self._streak, self.rng),
            self._streak,
        )
