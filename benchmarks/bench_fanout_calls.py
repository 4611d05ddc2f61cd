"""Python and C function calls per sync call to all N procs of one host (fanned out through
the agent), counted with `sys.setprofile`: a measure the load on the machine does not move.

* client: everything the calling thread does for one `actors.ok.call(i).get()` (building the
  call, the `FanOut`, receiving and unpacking the `RelayedReplies`, settling each rank);
* proc: what a proc's receiving thread does for its part of that call (counted inside the
  procs by an endpoint that installs the profiler on the thread that runs it).

The agent's part is in `bench_arena_calls.py` (its relay, per proc).

    python3 benchmarks/bench_fanout_calls.py [--procs 32] [--calls 40]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mesh import Actor, endpoint, this_host
from mesh.testing import fan_out_from

T = 120.0  # seconds: the bound on every wait


class Counted(Actor):
    def __init__(self) -> None:
        self.calls = 0

    @endpoint
    def ok(self, x: int) -> int:
        return x

    @endpoint
    def count_from_here(self) -> None:
        def profile(frame: Any, event: str, arg: Any) -> None:
            if event in ("call", "c_call"):
                self.calls += 1

        sys.setprofile(profile)  # this thread's: the one that receives the next calls

    @endpoint
    def counted(self) -> int:
        sys.setprofile(None)
        return self.calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=32)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    procs = this_host().spawn_procs(per_host={"procs": args.procs})
    try:
        with fan_out_from(1):
            actors = procs.spawn("counted", Counted)
            for i in range(30):  # warm: connections made, headers cached
                actors.ok.call(i).get(timeout=T)
            counted = [0]

            def profile(frame: Any, event: str, arg: Any) -> None:
                if event in ("call", "c_call"):
                    counted[0] += 1

            actors.count_from_here.call().get(timeout=T)
            sys.setprofile(profile)
            for i in range(args.calls):
                actors.ok.call(i).get(timeout=T)
            sys.setprofile(None)
            in_procs = sum(actors.counted.call().get(timeout=T).values())
    finally:
        procs.stop().get(timeout=T)
    print(f"client: a call to all {args.procs}       {counted[0] / args.calls:8.1f} calls")
    per_proc = in_procs / args.calls / args.procs
    print(f"proc: its part of that call, each  {per_proc:8.1f} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
