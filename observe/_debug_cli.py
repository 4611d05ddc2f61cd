"""``meshvisor debug``: the debug prompt in a terminal of its own, on the calls paused in
``breakpoint()`` by this user's local clients, or by the procs of a persistent allocation."""

from __future__ import annotations

import argparse
import signal
from types import FrameType

from observe._debug_agents import allocation_agents
from observe._debug_link import DebugClient
from observe._debug_prompt import DebugPrompt, terminal_io
from transport import TransportError

#: What ends the front end: its terminal closing, or being told to stop.
ENDING_SIGNALS = (signal.SIGHUP, signal.SIGTERM)


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
    try:
        agents = args.agent
        if args.allocation is not None:
            agents = [*(agents or ()), *allocation_agents(args.allocation)]
        client = DebugClient(agents)
    except (ValueError, OSError, TransportError) as error:
        parser.exit(2, f"{prog}: {error}\n")
    try:
        prompt = DebugPrompt(client, *terminal_io(None, None))
        _end_on_signals(prompt)
        prompt.run()
    finally:
        client.close()
    return 0


def _end_on_signals(prompt: DebugPrompt) -> None:
    """An ending signal while the prompt runs leaves it through SystemExit, once; after the
    prompt (while the link removes its socket and directory) it is ignored: the process is
    ending anyway, and the clean-up must not be cut short. Paused calls stay paused."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        for ending in ENDING_SIGNALS:
            signal.signal(ending, signal.SIG_IGN)
        if prompt.running:
            raise SystemExit(128 + signum)

    for signum in ENDING_SIGNALS:
        signal.signal(signum, on_signal)
