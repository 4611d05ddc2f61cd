"""When things go wrong: a small training job with a bug, and the tools that explain it.

    python3 examples/when_things_go_wrong.py           # rank 2 deadlocks in step 5
    python3 examples/when_things_go_wrong.py --oom     # rank 1 runs out of memory instead
    python3 examples/when_things_go_wrong.py --debug   # rank 2 stops in breakpoint() instead

The README's section "When things go wrong" walks through what each prints, and through
``meshvisor top``, ``meshvisor logs`` and ``meshvisor debug`` on this job.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

os.environ.setdefault("MESHVISOR_LOG_LEVEL", "error")  # keep the example's own output readable

from mesh import Actor, current_rank, endpoint, this_host


class Trainer(Actor):
    """One rank of a toy training job; `bug` says how step 5 goes wrong on one rank."""

    call_limit_s = 3.0  # a step still running after 3 s is "stuck": its caller hears at once

    def __init__(self, bug: str) -> None:
        self.bug = bug
        self.rank = current_rank().rank
        self.lock = threading.Lock()
        self.buffers: list[bytes] = []

    @endpoint
    def step(self, n: int) -> float:
        loss = 1.0 / (n + 1) + 0.001 * self.rank
        print(f"step {n} loss {loss:.4f}")  # the same line on every rank: shown once
        if n == 5 and self.rank == (1 if self.bug == "oom" else 2):
            if self.bug == "debug":
                breakpoint()  # `meshvisor debug` in another terminal
            elif self.bug == "oom":
                self.grow_buffers()
            else:
                self.apply_update()
        return loss

    def apply_update(self) -> None:
        with self.lock:
            self.log_update()

    def log_update(self) -> None:
        with self.lock:  # the bug: the same lock again (threading.Lock is not reentrant)
            pass

    def grow_buffers(self) -> None:
        # 4 GiB, far past the mesh's memory_limit (512 MiB). bytes(n) is zeroed by the kernel,
        # not written, so the limit is reached at once, well within call_limit_s even on a
        # loaded machine (bytearray(n) writes its zeros: 0.3 s of CPU before the limit).
        for _ in range(64):
            self.buffers.append(bytes(64 << 20))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bug = parser.add_mutually_exclusive_group()
    bug.add_argument("--oom", dest="bug", action="store_const", const="oom")
    bug.add_argument("--debug", dest="bug", action="store_const", const="debug")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between steps")
    args = parser.parse_args()

    procs = this_host().spawn_procs(per_host={"gpus": 4}, name="trainers", memory_limit="512MiB")
    procs.logging_option(stream_to_client=True, aggregate_window_sec=1.0).get()
    trainers = procs.spawn("trainers", Trainer, args.bug or "deadlock")
    for n in range(args.steps):
        losses = trainers.step.call(n).get()  # a failed rank raises SupervisionError here
        print(f"step {n}: mean loss {sum(losses.values()) / len(losses):.4f}", flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    main()
