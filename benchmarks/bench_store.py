"""A replica group's store: connecting and forming a gloo group through it, meshvisor's store
against torch's TCPStore, in the same run.

For each of `--rounds` rounds, for each store in turn (interleaved, so both see the same load):
two threads each open a fresh connection to the store and form a gloo process group of two
ranks through it, as two replicas joining a step's group do. Prints, per store, the median,
95th percentile and slowest time of a connection plus rendezvous, and how many took over 1 s
(torch's sockets look up the peer's name in DNS; a dropped query costs 5 s), and how many
failed.

    python3 benchmarks/bench_store.py [--rounds 60] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from recovery.testing import StoreClient, StoreServer

TIMEOUT = datetime.timedelta(seconds=60)


def torch_store() -> tuple[Callable[[], Any], Callable[[], None]]:
    """A client maker for a fresh TCPStore server, and its closing."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]

    def connect() -> Any:
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)  # type: ignore[attr-defined]

    return connect, lambda: None


def meshvisor_store() -> tuple[Callable[[], Any], Callable[[], None]]:
    server = StoreServer(name="bench")
    return lambda: StoreClient(server.addresses, TIMEOUT.total_seconds()), server.close


def join(connect: Callable[[], Any], tag: str, rank: int, times: list[float], held: list) -> None:
    """One connection and rendezvous; a failed one counts as infinitely long. The group is
    kept (`held`) until its peer formed it too: dropping it earlier fails the peer's."""
    started = time.perf_counter()
    try:
        client = connect()
        prefixed = dist.PrefixStore(tag, client)  # type: ignore[attr-defined]
        held.append((client, dist.ProcessGroupGloo(prefixed, rank, 2, TIMEOUT)))  # type: ignore[attr-defined]
    except Exception as exc:
        print(f"{tag} rank {rank} failed: {exc}", file=sys.stderr)
        times.append(math.inf)
        return
    times.append(time.perf_counter() - started)


def one_round(connect: Callable[[], Any], tag: str) -> list[float]:
    times: list[float] = []
    held: list[Any] = []
    threads = [threading.Thread(target=join, args=(connect, tag, r, times, held)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return times


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "joins": len(ordered),
        "median_ms": statistics.median(ordered) * 1e3,
        "p95_ms": ordered[int(0.95 * (len(ordered) - 1))] * 1e3,
        "max_ms": ordered[-1] * 1e3,
        "over_1s": sum(1 for t in ordered if 1.0 < t < math.inf),
        "failed": sum(1 for t in ordered if t == math.inf),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    stores = {"torch TCPStore": torch_store(), "meshvisor store": meshvisor_store()}
    times: dict[str, list[float]] = {name: [] for name in stores}
    try:
        for index in range(options.rounds):
            for name, (connect, _) in stores.items():
                times[name] += one_round(connect, f"round-{index}")
    finally:
        for _, close in stores.values():
            close()
    results = {name: summary(found) for name, found in times.items()}
    if options.json:
        print(json.dumps(results, indent=2))
        return
    header = ("store", "joins", "median ms", "p95 ms", "max ms", ">1 s", "failed")
    print("{:<16} {:>5} {:>10} {:>8} {:>8} {:>5} {:>6}".format(*header))
    for name, found in results.items():
        print(
            f"{name:<16} {found['joins']:>5} {found['median_ms']:>10.1f} {found['p95_ms']:>8.1f} "
            f"{found['max_ms']:>8.1f} {found['over_1s']:>5} {found['failed']:>6}"
        )


if __name__ == "__main__":
    main()
