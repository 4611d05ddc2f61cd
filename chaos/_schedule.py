"""Fault schedules: which faults strike where and when, drawn from a seed or scripted.
``plan`` is pure, so a schedule and a target set always give back the same faults."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, TypeAlias

from ._faults import FAULT_KINDS, FAULT_SPECS
from ._model import PlannedFault
from ._targets import Target, TargetSet


def _ceil_ms(x: float) -> float:
    """The smallest millisecond-rounded time (``round(t, 3) == t``) that is not before `x`,
    so that rounding never moves a fault into the window it was moved out of."""
    r = round(x, 3)
    if r < x:
        r = round(r + 0.001, 3)
    return r


def _format_weight(weight: float) -> str:
    """A weight as ``--faults`` spells it: ``3`` for 3.0, else the exact shortest repr."""
    if float(weight).is_integer():
        return str(int(weight))
    return repr(float(weight))


def _check_range(name: str, bounds: tuple[float, float]) -> None:
    lo, hi = bounds
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo <= hi):
        raise ValueError(
            f"{name} must be a range (low, high) with 0 <= low <= high, not {bounds!r}"
        )


def _describe_targets(targets: TargetSet) -> str:
    """Every target of `targets` in a few words, for error messages."""
    parts = [
        f"ranks 0-{size - 1} of mesh {name!r}" if size > 1 else f"rank 0 of mesh {name!r}"
        for name, size in targets.meshes
        if size > 0
    ]
    if targets.hosts > 0:
        parts.append(f"hosts 0-{targets.hosts - 1}" if targets.hosts > 1 else "host 0")
    if targets.client:
        parts.append("the client")
    return ", ".join(parts) if parts else "none"


@dataclass(frozen=True)
class RandomSchedule:
    """Faults drawn from a seed: arrivals of a Poisson process with mean gap `mtbf_s` within
    [`warmup_s`, `duration_s`), each of a kind drawn from the weighted mix `faults` and aimed
    at a free target of that kind's level.

    A fault occupies its target for its window, [at_s, at_s + duration + `settle_s`): no two
    windows on one target overlap, and at most `max_concurrent` windows overlap at all, so
    that each fault's effects can be told apart and recovered from. A fault that would
    break either rule waits for the earliest window to close (and the arrivals go on from
    there) or, when every target of its kind is taken, is dropped for the next arrival.
    """

    seed: int
    mtbf_s: float
    duration_s: float
    warmup_s: float = 1.0
    faults: tuple[tuple[str, float], ...] = (("kill", 1.0),)
    max_concurrent: int = 1
    settle_s: float = 2.0
    kill_signals: tuple[str, ...] = ("SIGKILL", "SIGTERM", "SIGSEGV")
    exit_codes: tuple[int, ...] = (1, 0)
    pause_s: tuple[float, float] = (0.5, 3.0)
    drop_probability: float = 0.3
    delay_ms: tuple[float, float] = (5.0, 50.0)
    window_s: tuple[float, float] = (0.5, 2.0)
    raise_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mtbf_s) and self.mtbf_s > 0):
            raise ValueError(f"mtbf_s must be a positive number of seconds, not {self.mtbf_s}")
        if not (math.isfinite(self.warmup_s) and self.warmup_s >= 0):
            raise ValueError(f"warmup_s cannot be negative, but it is {self.warmup_s}")
        if not (math.isfinite(self.duration_s) and self.duration_s > self.warmup_s):
            raise ValueError(
                f"duration_s ({self.duration_s}) must be greater than warmup_s ({self.warmup_s})"
            )
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, not {self.max_concurrent}")
        if not (math.isfinite(self.settle_s) and self.settle_s >= 0):
            raise ValueError(f"settle_s cannot be negative, but it is {self.settle_s}")
        if not self.faults:
            raise ValueError("the fault mix needs at least one kind")
        seen: set[str] = set()
        for kind, weight in self.faults:
            if kind not in FAULT_KINDS:
                raise ValueError(
                    f"unknown fault kind {kind!r} in the mix; known: {', '.join(FAULT_KINDS)}"
                )
            if kind in seen:
                raise ValueError(f"fault kind {kind!r} appears twice in the mix")
            seen.add(kind)
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(
                    f"the weight of {kind!r} must be a positive number, not {weight!r}"
                )
        for kind, _ in self.faults:
            FAULT_SPECS[kind].check_ranges(self)
        if not 0.0 <= self.drop_probability <= 1.0:
            raise ValueError(f"drop_probability must be within [0, 1], not {self.drop_probability}")
        _check_range("pause_s", self.pause_s)
        _check_range("delay_ms", self.delay_ms)
        _check_range("window_s", self.window_s)

    @classmethod
    def from_mix(
        cls, seed: int, mtbf_s: float, duration_s: float, faults: str, **kwargs: Any
    ) -> RandomSchedule:
        """Build a schedule from the ``--faults`` string, e.g. ``"kill,pause,drop"`` or
        ``"kill:3,pause:1"`` (kind[:weight], weight 1 when left out). Other parameters are
        passed through as keywords."""
        known = ", ".join(FAULT_KINDS)
        mix: list[tuple[str, float]] = []
        for raw in faults.split(","):
            item = raw.strip()
            if not item:
                raise ValueError(
                    f"empty item in the fault mix {faults!r}; expected kind[:weight],... "
                    f"with kinds from: {known}"
                )
            kind, sep, weight_text = item.partition(":")
            kind = kind.strip()
            if kind not in FAULT_KINDS:
                raise ValueError(f"unknown fault kind {kind!r} in {item!r}; known: {known}")
            weight = 1.0
            if sep:
                try:
                    weight = float(weight_text)
                except ValueError:
                    raise ValueError(
                        f"bad weight in {item!r}: {weight_text.strip()!r} is not a number"
                    ) from None
                if not (math.isfinite(weight) and weight > 0):
                    raise ValueError(f"bad weight in {item!r}: weights must be positive")
            if any(kind == k for k, _ in mix):
                raise ValueError(f"fault kind {kind!r} appears twice in {faults!r}")
            mix.append((kind, weight))
        return cls(seed=seed, mtbf_s=mtbf_s, duration_s=duration_s, faults=tuple(mix), **kwargs)

    def kinds(self) -> tuple[str, ...]:
        """The fault kinds this schedule may plan."""
        return tuple(kind for kind, _ in self.faults)

    @property
    def mix(self) -> str:
        """The fault mix as ``--faults`` spells it, e.g. ``"kill:1,pause:0.5"``."""
        return ",".join(f"{kind}:{_format_weight(weight)}" for kind, weight in self.faults)

    def window(self, planned: PlannedFault) -> tuple[float, float]:
        """The time `planned` occupies its target: [start, end)."""
        return planned.at_s, planned.at_s + planned.fault.duration_s + self.settle_s

    def plan(self, targets: TargetSet) -> list[PlannedFault]:
        """The faults to inject into `targets`, sorted by time. Pure: the same schedule and
        target set always give the same plan; only ``random.Random(seed)`` is used."""
        rng = random.Random(self.seed)
        candidates = {kind: targets.candidates(FAULT_SPECS[kind].level) for kind, _ in self.faults}
        mix = [(kind, weight) for kind, weight in self.faults if candidates[kind]]
        if not mix:
            return []
        kinds = [kind for kind, _ in mix]
        weights = [weight for _, weight in mix]

        planned: list[PlannedFault] = []
        open_windows: list[tuple[float, Target]] = []  # (end, target) of windows not yet closed
        clock = self.warmup_s  # the arrival process, unrounded
        while True:
            clock += rng.expovariate(1.0 / self.mtbf_s)
            at = _ceil_ms(clock)
            if at >= self.duration_s:
                break
            kind = rng.choices(kinds, weights)[0]
            fault = FAULT_SPECS[kind].draw(self, rng)
            # Every planned fault starts at or before `at`, so a window overlaps [at, ...)
            # exactly when it ends after `at`.
            open_windows = [(end, t) for end, t in open_windows if end > at]
            if len(open_windows) >= self.max_concurrent:
                at = _ceil_ms(min(end for end, _ in open_windows))
                if at >= self.duration_s:
                    break
                clock = at
                open_windows = [(end, t) for end, t in open_windows if end > at]
            busy = {t for _, t in open_windows}
            free = [t for t in candidates[kind] if t not in busy]
            if not free:
                continue
            target = rng.choice(free)
            pf = PlannedFault(at, fault, target)
            planned.append(pf)
            open_windows.append((self.window(pf)[1], target))
        planned.sort(key=lambda p: p.at_s)
        return planned

    def to_dict(self) -> dict[str, Any]:
        """Every parameter, JSON-able, for the run's report."""
        return {
            "type": "random",
            "seed": self.seed,
            "mtbf_s": self.mtbf_s,
            "duration_s": self.duration_s,
            "warmup_s": self.warmup_s,
            "faults": [[kind, weight] for kind, weight in self.faults],
            "mix": self.mix,
            "max_concurrent": self.max_concurrent,
            "settle_s": self.settle_s,
            "kill_signals": list(self.kill_signals),
            "exit_codes": list(self.exit_codes),
            "pause_s": list(self.pause_s),
            "drop_probability": self.drop_probability,
            "delay_ms": list(self.delay_ms),
            "window_s": list(self.window_s),
            "raise_endpoint": self.raise_endpoint,
        }

    def replay_args(self) -> list[str]:
        """The command-line options that rebuild this schedule, for the report's "replay
        with" line. Parameters without a command-line option (settle_s, the fault parameter
        ranges, raise_endpoint) are not included; they are in ``to_dict``."""
        return [
            "--seed",
            str(self.seed),
            "--mtbf",
            str(self.mtbf_s),
            "--duration",
            str(self.duration_s),
            "--faults",
            self.mix,
            "--warmup",
            str(self.warmup_s),
            "--max-concurrent",
            str(self.max_concurrent),
        ]


@dataclass(frozen=True)
class ScriptedSchedule:
    """Faults given one by one, for reproducing a specific scenario."""

    faults: tuple[PlannedFault, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", tuple(self.faults))

    @property
    def seed(self) -> None:
        """A scripted schedule has no seed."""
        return None

    def kinds(self) -> tuple[str, ...]:
        """The fault kinds this schedule plans, each once."""
        return tuple(dict.fromkeys(pf.fault.kind for pf in self.faults))

    def plan(self, targets: TargetSet) -> list[PlannedFault]:
        """The faults sorted by time, after checking that each is aimed at a target of
        `targets` of the level its kind needs."""
        for pf in self.faults:
            if pf.target not in targets:
                raise ValueError(
                    f"the {pf.fault.describe()} at {pf.at_s:g} s is aimed at {pf.target}, "
                    f"which does not exist; the targets are: {_describe_targets(targets)}"
                )
            level = pf.fault.spec.level
            if pf.target.level != level:
                raise ValueError(
                    f"the {pf.fault.describe()} at {pf.at_s:g} s is aimed at {pf.target}, "
                    f"but a {pf.fault.kind!r} fault must be aimed at a {level}"
                )
        return sorted(self.faults, key=lambda p: p.at_s)

    def to_dict(self) -> dict[str, Any]:
        """The faults, JSON-able, for the run's report."""
        return {"type": "scripted", "faults": [pf.to_dict() for pf in self.faults]}

    def replay_args(self) -> list[str]:
        """No command-line options reproduce a scripted schedule."""
        return []


#: Either kind of schedule; both have ``plan``, ``kinds``, ``to_dict``, ``replay_args`` and
#: ``seed``.
Schedule: TypeAlias = RandomSchedule | ScriptedSchedule
