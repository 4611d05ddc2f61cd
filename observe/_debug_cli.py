"""``meshvisor debug``: the debug prompt in a terminal of its own, on the calls paused in
``breakpoint()`` by this user's local clients, or by the procs of a persistent allocation."""

from __future__ import annotations

import argparse
import signal
from types import FrameType

from observe._debug_prompt import debug


def main(argv: list[str], prog: str = "meshvisor debug") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument(
        "--allocation", help="debug the procs of this persistent allocation (a name or a file)"
    )
    parser.add_argument(
        "--agent",
        action="append",
        default=None,
        help="the address of a host agent whose procs to debug (repeat for several)",
    )
    args = parser.parse_args(argv)
    for signum in (signal.SIGHUP, signal.SIGTERM):  # a closed terminal: clean up, then exit
        signal.signal(signum, _exit_on_signal)
    try:
        debug(agents=args.agent, allocation=args.allocation)
    except (ValueError, OSError) as error:
        parser.exit(2, f"{prog}: {error}\n")
    return 0


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    """Leave through SystemExit, so that the link removes its socket and directory; paused
    calls stay paused."""
    raise SystemExit(128 + signum)
