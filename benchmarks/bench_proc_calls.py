"""Python and C function calls per message on a proc's receiving thread, counted with
`sys.setprofile`: a measure the load on the machine does not move (issue 17, point 1).

    python3 benchmarks/bench_proc_calls.py           # round trip and pipelined
    python3 benchmarks/bench_proc_calls.py --top 20  # and the functions called most
    python3 benchmarks/bench_proc_calls.py --all 32  # per proc of calls to all 32 procs

With `--all N`, N procs count at once while the script calls all of them, one call to all
at a time, with an empty argument and with 1 MB (shared through the agent's payload arena).

An endpoint installs the profile function on the thread that runs it (in a proc, the
receiver: it runs the sync calls of an idle actor itself), then the script makes 3000 calls
of `ping(0)`, one at a time (round trip) or all issued before collecting (pipelined), and a
second endpoint takes the counts back. Both ends check that the counting thread was the one
that ran the calls in between (a hand-over to another worker thread would count nothing).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
from typing import Any

os.environ.setdefault("MESHVISOR_LOG_LEVEL", "error")  # before meshvisor reads it

from mesh import Actor, endpoint, this_host

CALLS = 3000


class Counted(Actor):
    """The callee: `ping` answers with its argument; `count_from_here` and `counts` count."""

    def __init__(self) -> None:
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._thread = 0

    @endpoint
    def ping(self, x: Any = None) -> Any:
        return x

    @endpoint
    def length(self, x: bytes) -> int:
        return len(x)

    @endpoint
    def count_from_here(self) -> None:
        counts, self._thread = self._counts, threading.get_ident()
        counts.clear()

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call":
                code = frame.f_code
                counts["py", f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1
            elif event == "c_call":
                counts["c", getattr(arg, "__qualname__", repr(arg))] += 1

        sys.setprofile(profile)

    @endpoint
    def counts(self) -> tuple[dict[tuple[str, str], int], bool]:
        sys.setprofile(None)
        return dict(self._counts), self._thread == threading.get_ident()


def counted(actor: Any, pipelined: bool) -> collections.Counter[tuple[str, str]]:
    """The calls the receiving thread made for `CALLS` pings."""
    actor.count_from_here.call_one().get(timeout=60)
    if pipelined:
        for future in [actor.ping.call_one(0) for _ in range(CALLS)]:
            future.get(timeout=60)
    else:
        for _ in range(CALLS):
            actor.ping.call_one(0).get(timeout=60)
    counts, same_thread = actor.counts.call_one().get(timeout=60)
    if not same_thread:
        raise SystemExit("the calls ran on another thread than the one counting: run again")
    return collections.Counter({tuple(key): value for key, value in counts.items()})


def counted_all(actors: Any, argument: Any, calls: int) -> collections.Counter[tuple[str, str]]:
    """The calls all procs' receiving threads made for `calls` calls to all of `actors`
    (`ping` for an empty argument, `length` for bytes: the answer stays small)."""
    called = actors.length if argument else actors.ping
    actors.count_from_here.call().get(timeout=60)
    for _ in range(calls):
        called.call(argument).get(timeout=60)
    total: collections.Counter[tuple[str, str]] = collections.Counter()
    for _, (counts, same_thread) in actors.counts.call().get(timeout=60):
        if not same_thread:
            raise SystemExit("the calls ran on another thread than the one counting: run again")
        total.update({tuple(key): value for key, value in counts.items()})
    return total


def report(
    label: str, counts: collections.Counter[tuple[str, str]], top: int, per: int = CALLS
) -> None:
    python = sum(v for (kind, _), v in counts.items() if kind == "py") / per
    native = sum(v for (kind, _), v in counts.items() if kind == "c") / per
    print(f"{label:11s} Python calls {python:5.1f}, C calls {native:5.1f} per message")
    for (kind, name), value in counts.most_common(top):
        print(f"    {value / per:6.2f} {kind:2s} {name}")


def fan_out(host: Any, procs: int, top: int) -> None:
    """Per proc and call, calls to all `procs` procs of an empty and of a 1 MB argument."""
    actors = host.spawn_procs(per_host={"procs": procs}, name="all").spawn("a", Counted)
    megabyte, calls = os.urandom(1 << 20), 200
    for _ in range(30):  # warm: routes learnt, arena mapped
        actors.ping.call().get(timeout=60)
        actors.length.call(megabyte).get(timeout=60)
    report(f"all {procs}", counted_all(actors, None, calls), top, calls * procs)
    report("all, 1 MB", counted_all(actors, megabyte, calls), top, calls * procs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=0, help="also list the N most called")
    parser.add_argument("--all", type=int, default=0, help="per proc of calls to all N procs")
    args = parser.parse_args(argv)
    host = this_host()
    try:
        if args.all:
            fan_out(host, args.all, args.top)
            return 0
        actor = host.spawn_procs(per_host={"procs": 1}, name="counted").spawn("c", Counted)
        for _ in range(300):  # warm: headers prepared, threads started
            actor.ping.call_one(0).get(timeout=60)
        report("round trip", counted(actor, pipelined=False), args.top)
        report("pipelined", counted(actor, pipelined=True), args.top)
    finally:
        host.shutdown().get(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
