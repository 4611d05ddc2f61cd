"""A meshvisor client run as a subprocess by tests/test_call_watchdog.py: a stuck call at the
root, with no handler. Prints the lines of `failfast_client` (``PIDS``, ``PROCS``, ``RESULT``).

The main thread catches the `SupervisionError` of the stuck call; the proc's death that follows
(its owner kills it) is the same failure, so fail-fast must not interrupt the main thread again
while it then sleeps. ``RESULT {"first": ..., "second": ...}``: the event caught from the call,
and the one that interrupted the sleep (null: none did, as it should be).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the actors
sys.path.insert(0, str(Path(__file__).resolve().parent))  # failfast_client's helpers

import stuck_actors as sa
from failfast_client import WAIT_S, describe, emit, start

from supervision import SupervisionError


def main() -> None:
    procs, _, _ = start(1)
    stuck = procs.spawn("stuck", sa.Stuck)
    try:
        stuck.wait_on_lock.call_one().get(timeout=WAIT_S)
    except SupervisionError as exc:
        first = describe(exc.event)
    else:
        sys.exit(3)
    try:
        time.sleep(4 * sa.LIMIT_S)  # the proc is killed and its failure decided meanwhile
    except SupervisionError as exc:
        emit("RESULT", {"first": first, "second": describe(exc.event)})
        return
    emit("RESULT", {"first": first, "second": None})


if __name__ == "__main__":
    main()
