"""Healing bandwidth: a replacement replica pulls a model's state from 1 and from 2 live peers,
beside the raw transport floor measured in the same run.

For states of 64 MB, 256 MB and 1 GB (parameters plus Adam's two moments: a third each), one
replica proc heals from one, then from two donor procs (`Replica.heal_from`: chunks streamed
from every peer at once). Two baselines, same run, same bytes: a raw pyzmq PUSH/PULL of the
bytes over ipc between two processes, in messages of the heal's chunk size, without meshvisor
(the floor, taken in each rep right before that rep's heals, so that each heal's ratio to the
floor is measured under the same load), and the old path: one call returning the whole state
pickled (tensors out of band), loaded with `load_state_dict`. Prints a table of seconds and
GB/s (1 GB = 1e9 bytes) with each heal's bandwidth as a share of the floor's (median over
reps). The target (issue #16): a 1 GB state heals at >= 1 GB/s.

    python3 benchmarks/bench_heal.py [--sizes 64,256,1000] [--reps 3] [--chunk-mib 8]
        [--window 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("MESHVISOR_LOG_LEVEL", "error")

import torch
import zmq

from mesh import ActorMesh, endpoint, this_host
from recovery import Replica

TARGET_GBPS = 1.0
TENSOR_BYTES = 64 << 20  # the model is a list of flat tensors of at most this size


class StateOfSize(Replica):
    """A replica whose state (parameters + Adam moments) holds `nbytes` bytes."""

    def __init__(self, nbytes: int, chunk_bytes: int, window: int) -> None:
        self.nbytes = nbytes
        self.heal_chunk_bytes, self.heal_window = chunk_bytes, window
        super().__init__()

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        params, left = [], self.nbytes // 3 // 4  # float32 parameters, a third of the state
        while left > 0:
            count = min(left, TENSOR_BYTES // 4)
            params.append(torch.nn.Parameter(torch.full((count,), 0.5)))
            left -= count
        model = torch.nn.ParameterList(params)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    @endpoint
    def warm_up(self, seed: int) -> int:
        """One optimizer step on seeded gradients: the Adam moments exist; the state's bytes."""
        generator = torch.Generator().manual_seed(seed)
        for param in self.model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.committed_step = 1
        return sum(t.nbytes for t in _tensors(self.optimizer.state_dict())) + sum(
            p.nbytes for p in self.model.parameters()
        )

    @endpoint
    def heal_whole(self, peer: ActorMesh[StateOfSize]) -> float:
        """The old path: the whole state in one reply; seconds taken."""
        started = time.perf_counter()
        state = peer.state.call_one().get(timeout=600)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.committed_step = state["step"]
        return time.perf_counter() - started

    @endpoint
    def drop_state(self) -> None:
        """Forget the optimizer state, as a fresh replacement holds none."""
        self.optimizer.state.clear()

    @endpoint
    def reset_peak(self) -> int:
        """Reset this process's peak resident size (Linux); the resident bytes now."""
        Path("/proc/self/clear_refs").write_text("5")
        return _status_bytes("VmRSS")

    @endpoint
    def peak(self) -> int:
        return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _raw_receiver(address: str, total: int, done: Any) -> None:
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.bind(address)
    done.send("ready")
    received = 0
    while received < total:
        received += len(pull.recv(copy=False).buffer)
    done.send("done")
    pull.close(linger=0)
    context.term()


def raw_floor(total: int, chunk: int, folder: str) -> float:
    """Seconds to push `total` bytes in `chunk`-byte messages over pyzmq ipc to another
    process (the transport's floor: no pickling, no actor calls)."""
    address = f"ipc://{folder}/raw-{total}"
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("spawn").Process(
        target=_raw_receiver, args=(address, total, child)
    )
    proc.start()
    try:
        assert parent.poll(60) and parent.recv() == "ready"
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.connect(address)
        payload = memoryview(bytearray(os.urandom(1 << 20)) * (chunk >> 20 or 1))[:chunk]
        started = time.perf_counter()
        sent = 0
        while sent < total:
            push.send(payload[: min(chunk, total - sent)], copy=False)
            sent += chunk
        assert parent.poll(600) and parent.recv() == "done"
        seconds = time.perf_counter() - started
        push.close(linger=0)
        context.term()
        return seconds
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def measure(nbytes: int, reps: int, folder: str, chunk: int, window: int) -> dict[str, Any]:
    """Seconds (medians) of the floor, the heals and the old path for an `nbytes` state, and
    each heal's bandwidth as a share of the floor's, floor and heal taken in the same rep."""
    procs = this_host().spawn_procs(per_host={"replica": 3}, name=f"heal{nbytes}")
    try:
        replicas = procs.spawn("replicas", StateOfSize, nbytes, chunk, window)
        donors = [replicas.slice(replica=0), replicas.slice(replica=1)]
        receiver = replicas.slice(replica=2)
        state_bytes = donors[0].warm_up.call_one(7).get(timeout=600)
        donors[1].warm_up.call_one(7).get(timeout=600)
        row: dict[str, Any] = {"bytes": state_bytes, "receiver extra": 0.0, "donor extra": 0.0}
        times: dict[str, list[float]] = {"raw zmq": [], "1 peer": [], "2 peers": []}
        ratios: dict[str, list[float]] = {"1 peer": [], "2 peers": []}
        for _ in range(reps):  # floor and heals interleaved: each ratio under the same load
            floor = raw_floor(state_bytes, chunk, folder)
            times["raw zmq"].append(floor)
            for label, peers in (("1 peer", donors[:1]), ("2 peers", donors)):
                seconds = _heal_once(row, receiver, peers, state_bytes)
                times[label].append(seconds)
                ratios[label].append(floor / seconds)
        for label, values in times.items():
            row[label] = statistics.median(values)
        for label, values in ratios.items():
            row[label + " ratio"] = statistics.median(values)
        old = []
        for _ in range(reps):
            receiver.drop_state.call_one().get(timeout=60)
            old.append(receiver.heal_whole.call_one(donors[0]).get(timeout=600))
        row["old path"] = statistics.median(old)
        return row
    finally:
        procs.stop().get(timeout=60)


def _heal_once(
    row: dict[str, Any], receiver: ActorMesh[StateOfSize], peers: list[Any], state_bytes: int
) -> float:
    """Seconds of one heal of a receiver without optimizer state; records peak memory growth."""
    receiver.drop_state.call_one().get(timeout=60)
    everyone = [receiver, *peers]
    before = [p.reset_peak.call_one().get(timeout=60) for p in everyone]
    report = receiver.heal_from.call_one(peers).get(timeout=600)
    grown = [p.peak.call_one().get(timeout=60) - b for p, b in zip(everyone, before)]
    receiver_extra = (grown[0] - report.allocated_bytes) / state_bytes
    row["receiver extra"] = max(row["receiver extra"], receiver_extra)
    row["donor extra"] = max(row["donor extra"], max(grown[1:]) / state_bytes)
    return float(report.seconds)


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = ("raw zmq", "1 peer", "2 peers", "old path")
    print(f"{'state':>8}  " + "  ".join(f"{c + ' s (GB/s)':>20}" for c in columns), end="")
    print(f"  {'1 peer / floor':>14}  {'2 peers / floor':>15}")
    for row in rows:
        cells = []
        for column in columns:
            seconds = row[column]
            cells.append(f"{seconds:9.3f} ({row['bytes'] / seconds / 1e9:6.2f})")
        print(f"{row['bytes'] / 1e6:6.0f}MB  " + "  ".join(f"{c:>20}" for c in cells), end="")
        print(f"  {row['1 peer ratio']:14.2f}  {row['2 peers ratio']:15.2f}")
    print(
        "peak resident growth during a heal, beyond the state it makes, as a share of the state "
        "(max over runs): "
        + ", ".join(
            f"{r['bytes'] / 1e6:.0f} MB: receiver {r['receiver extra']:.2f}, "
            f"donor {r['donor extra']:.2f}"
            for r in rows
        )
    )
    for row in rows:
        best = min(row["1 peer"], row["2 peers"])
        print(
            f"{row['bytes'] / 1e6:.0f} MB: 2 peers vs 1: {row['1 peer'] / row['2 peers']:.2f}x; "
            f"vs old path: {row['old path'] / best:.2f}x faster"
        )
    big = rows[-1]
    rate = big["bytes"] / min(big["1 peer"], big["2 peers"]) / 1e9
    verdict = "PASS" if rate >= TARGET_GBPS else "MISS"
    print(f"target: the largest state heals at >= {TARGET_GBPS} GB/s: {rate:.2f} GB/s, {verdict}")
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256,1000", help="state sizes in MB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=StateOfSize.heal_chunk_bytes >> 20)
    parser.add_argument("--window", type=int, default=StateOfSize.heal_window)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshvisor-bench-heal-") as folder:
        for megabytes in (int(size) for size in args.sizes.split(",")):
            chunk = args.chunk_mib << 20
            rows.append(measure(megabytes * 1_000_000, args.reps, folder, chunk, args.window))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
