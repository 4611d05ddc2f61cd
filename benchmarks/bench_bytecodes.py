"""Bytecodes per sync round trip on each side, counted with `sys.settrace`: a figure the load
on the machine does not move (issue 17, point 1).

    python3 benchmarks/bench_bytecodes.py            # caller and callee, per message
    python3 benchmarks/bench_bytecodes.py --top 15   # and the functions that run the most

The caller is this script's main thread (it pumps its own reply inbox in `get()`); the callee
is the proc's receiving thread (it runs an idle actor's sync calls itself). On each, a trace
function with `f_trace_opcodes` counts every bytecode executed (the frames already running
included) over 2000 calls of `ping(0)`, one at a time; Python function calls are counted too.
Both ends check that the callee's counting thread was the one that ran the calls. The same
again with the 2000 calls pipelined (all issued, then collected: replies come in batches).

Then, untraced, the CPU time each of those two threads uses per round trip (`thread_time`,
median of 5 x 2000): the load on the machine moves it much less than the wall time, though
more than the counts (caches shared with other processes).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

os.environ.setdefault("MESHVISOR_LOG_LEVEL", "error")  # before meshvisor reads it

from mesh import Actor, endpoint, this_host

CALLS = 2000
Counts = collections.Counter[str]


class OpcodeCounter:
    """Counts opcodes (per function) and Python calls on the thread that starts it."""

    def __init__(self) -> None:
        self.opcodes: Counts = collections.Counter()
        self.calls = 0

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            self.calls += 1
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
        elif event == "opcode":
            code = frame.f_code
            self.opcodes[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1
        return self._trace

    def start(self) -> None:
        """Trace new frames of this thread, and those already running below the caller."""
        frame = sys._getframe(1)
        while frame is not None:
            frame.f_trace, frame.f_trace_opcodes, frame.f_trace_lines = self._trace, True, False
            frame = frame.f_back  # type: ignore[assignment]
        sys.settrace(self._trace)

    def stop(self) -> None:
        sys.settrace(None)
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            frame.f_trace = None
            frame = frame.f_back


class Counted(Actor):
    """The callee: `ping` answers with its argument; the others count on the calling thread."""

    def __init__(self) -> None:
        self._counter = OpcodeCounter()
        self._thread = 0

    @endpoint
    def ping(self, x: Any = None) -> Any:
        return x

    @endpoint
    def count_from_here(self) -> None:
        self._counter, self._thread = OpcodeCounter(), threading.get_ident()
        self._counter.start()

    @endpoint
    def cpu(self) -> tuple[float, int]:
        """This thread's CPU time and its id."""
        return time.thread_time(), threading.get_ident()

    @endpoint
    def counts(self) -> tuple[dict[str, int], int, bool]:
        self._counter.stop()
        counter = self._counter
        return dict(counter.opcodes), counter.calls, self._thread == threading.get_ident()


@contextmanager
def counting(counter: OpcodeCounter) -> Iterator[None]:
    counter.start()
    try:
        yield
    finally:
        counter.stop()


def report(label: str, opcodes: Counts, calls: int, top: int) -> None:
    total = sum(opcodes.values()) / CALLS
    print(f"{label:17s} {total:7.0f} bytecodes, {calls / CALLS:5.1f} Python calls per message")
    for name, value in opcodes.most_common(top):
        print(f"    {value / CALLS:7.1f} {name}")


def counted(actor: Any, pipelined: bool) -> tuple[OpcodeCounter, Counts, int]:
    """What both sides ran for `CALLS` pings: one at a time, as bench_messaging.py's round
    trip, or all issued before any is collected (its replies then come in batches)."""
    ping = actor.ping
    actor.count_from_here.call_one().get(timeout=60)
    mine = OpcodeCounter()
    with counting(mine):
        if pipelined:
            for future in [ping.call_one(0) for _ in range(CALLS)]:
                future.get()
        else:
            for _ in range(CALLS):
                ping.call_one(0).get()
    theirs, calls, same_thread = actor.counts.call_one().get(timeout=60)
    if not same_thread:
        raise SystemExit("the calls ran on another thread than the one counting: run again")
    return mine, collections.Counter(theirs), calls


def cpu_per_round_trip(actor: Any) -> tuple[float, float]:
    """(caller's, callee's) CPU microseconds per round trip, each the median of 5 runs."""
    ping, cpu = actor.ping, actor.cpu
    mine: list[float] = []
    theirs: list[float] = []
    while len(mine) < 5:
        before, start = cpu.call_one().get(timeout=60), time.thread_time()
        for _ in range(CALLS):
            ping.call_one(0).get()
        end, after = time.thread_time(), cpu.call_one().get(timeout=60)
        if before[1] == after[1]:  # else the inbox changed threads: measure again
            mine.append((end - start) / CALLS * 1e6)
            theirs.append((after[0] - before[0]) / CALLS * 1e6)
    return statistics.median(mine), statistics.median(theirs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=0, help="also list the N busiest functions")
    args = parser.parse_args(argv)
    host = this_host()
    try:
        actor = host.spawn_procs(per_host={"procs": 1}, name="counted").spawn("c", Counted)
        ping = actor.ping
        for _ in range(300):  # warm: headers prepared, threads started
            ping.call_one(0).get(timeout=60)
        for pipelined in (False, True):
            how = "pipelined" if pipelined else "round trip"
            mine, theirs, calls = counted(actor, pipelined)
            report(f"caller, {how}", mine.opcodes, mine.calls, args.top)
            report(f"callee, {how}", theirs, calls, args.top)
        caller_us, callee_us = cpu_per_round_trip(actor)
        load = os.getloadavg()[0]
        print(
            f"CPU per round trip: caller thread {caller_us:.1f} us, callee thread "
            f"{callee_us:.1f} us (load average {load:.2f} on {os.cpu_count()} cpus)"
        )
    finally:
        host.shutdown().get(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
