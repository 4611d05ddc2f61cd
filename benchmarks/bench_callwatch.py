"""What the call watchdog costs a call: round trips to endpoints with and without a limit.

    python3 benchmarks/bench_callwatch.py            # a table
    python3 benchmarks/bench_callwatch.py --json     # the same rows as JSON

Two procs, one actor each: `Free` has no limit (its proc never starts the watch), `Watched`
limits every endpoint (``call_limit_s``: its proc runs the watch thread and each call notes
when and where it started). For a sync and an async endpoint, batches of blocking
``call_one`` round trips alternate between the two, so that both see the same machine; the
row gives the median batch of each, and the median of the ratios watched / free of
neighbouring batches: the watchdog's cost (target: within noise, <= 1.05). A last row times
what a call does for the watchdog itself, in this process: noting a call in progress without
and with a limit, in nanoseconds. Numbers are only comparable within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import timeit
from typing import Any

os.environ.setdefault("MESHVISOR_LOG_LEVEL", "error")  # before meshvisor reads it

from mesh import Actor, ActorMesh, endpoint, this_host
from mesh._engine.callwatch import Limit, RunningCall
from mesh._engine.messages import CallActor

BATCHES = 41
CALLS_PER_BATCH = 100
TARGET_RATIO = 1.05


class Free(Actor):
    @endpoint
    def ping(self, value: int) -> int:
        return value

    @endpoint
    async def aping(self, value: int) -> int:
        return value


class Watched(Free):
    call_limit_s = 600.0  # every endpoint, inherited ones included


def batch_us(actors: ActorMesh[Any], name: str) -> float:
    """Microseconds per round trip over one batch of blocking calls."""
    call = getattr(actors, name)
    started = time.perf_counter()
    for i in range(CALLS_PER_BATCH):
        call.call_one(i).get(timeout=30)
    return (time.perf_counter() - started) / CALLS_PER_BATCH * 1e6


def measure(free: ActorMesh[Any], watched: ActorMesh[Any], name: str) -> dict[str, Any]:
    """Alternating batches on both meshes; medians and their ratio."""
    for actors in (free, watched):  # warm up: threads, sockets, caches
        batch_us(actors, name)
    times: dict[str, list[float]] = {"free": [], "watched": []}
    for index in range(BATCHES):
        order = [("free", free), ("watched", watched)]
        for label, actors in order if index % 2 == 0 else reversed(order):
            times[label].append(batch_us(actors, name))
    free_us, watched_us = statistics.median(times["free"]), statistics.median(times["watched"])
    # Neighbouring batches see the same load: the median of their ratios is the steadiest.
    ratio = statistics.median(w / f for f, w in zip(times["free"], times["watched"], strict=True))
    return {
        "endpoint": f"{name} ({'async' if name.startswith('a') else 'sync'})",
        "free_us": round(free_us, 1),
        "watched_us": round(watched_us, 1),
        "ratio": round(ratio, 3),
        "status": "PASS" if ratio <= TARGET_RATIO else "MISS",
    }


def record_ns() -> dict[str, Any]:
    """Nanoseconds to note a call in progress, without and with a limit (in this process)."""
    header = CallActor(1, "ipc://x", "actor", "ping", ("gpus",), (1,), 0)
    limit = Limit(600.0, "set on the endpoint")
    timings = {}
    for label, given in (("free", None), ("watched", limit)):
        runs = timeit.repeat(
            lambda g=given: RunningCall(header, g, False), number=100_000, repeat=7
        )
        timings[label] = min(runs) / 100_000 * 1e9
    return {
        "endpoint": "note one call (ns)",
        "free_us": round(timings["free"], 1),
        "watched_us": round(timings["watched"], 1),
        "ratio": round(timings["watched"] / timings["free"], 3),
        "status": "info",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="bench")
    try:
        free = procs.slice(gpus=0).spawn("free", Free)
        watched = procs.slice(gpus=1).spawn("watched", Watched)
        rows = [measure(free, watched, name) for name in ("ping", "aping")]
        rows.append(record_ns())
    finally:
        procs.stop().get(timeout=30)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"call_one round trip, median of {BATCHES} batches of {CALLS_PER_BATCH} (us/call);")
    print("ratio: median of limited / no limit over neighbouring batches")
    print(f"{'endpoint':<16} {'no limit':>10} {'limited':>10} {'ratio':>7}  target <= 1.05")
    for row in rows:
        print(
            f"{row['endpoint']:<16} {row['free_us']:>10} {row['watched_us']:>10} "
            f"{row['ratio']:>7}  {row['status']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
