"""Nearest-rank percentiles, the summary a chaos report gives of detection and recovery
times (shared by the report model and its validator)."""

from __future__ import annotations

import math
from collections.abc import Sequence

#: The percentiles reported, as (key, percent).
_PERCENTS: tuple[tuple[str, int], ...] = (("p50", 50), ("p90", 90), ("p99", 99))
#: The keys of every summary `percentiles` returns, in report order.
PERCENTILE_KEYS: tuple[str, ...] = ("count", "p50", "p90", "p99", "max", "mean")


def percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    """Summarise `values`: ``count``, ``p50``, ``p90``, ``p99``, ``max`` and ``mean``.

    Percentiles use the nearest-rank method: the p-th percentile of n sorted values is the
    value at (1-based) rank ``ceil(p * n / 100)``, i.e. the smallest value such that at least
    p % of the values are less than or equal to it. It is always one of the values (never an
    interpolation). For an empty input ``count`` is 0 and every other key is None.
    """
    ordered = sorted(float(v) for v in values)
    n = len(ordered)
    result: dict[str, float | int | None] = {"count": n}
    for key, percent in _PERCENTS:
        # Integer ceil(percent * n / 100), free of floating-point rounding.
        rank = -(-percent * n // 100)
        result[key] = ordered[rank - 1] if n else None
    result["max"] = ordered[-1] if n else None
    result["mean"] = math.fsum(ordered) / n if n else None
    return result
