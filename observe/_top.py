"""``meshvisor top``: the live supervision tree of a running client or allocation, read-only.

Without a target it shows every running client on this machine (their local agents); with
``--json`` it prints one snapshot as JSON (docs/live-view.md has its schema) and exits: 0 when
every agent answered, 1 when some did not (they are listed under ``unreachable``), 2 when the
target cannot be found.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from observe._json_form import snapshot_json
from observe._snapshot import DEFAULT_TIMEOUT_S, SnapshotReader
from observe._targets import (
    Target,
    TargetError,
    agents_target,
    allocation_target,
    client_target,
    slurm_target,
)
from transport import TransportError


def main(argv: list[str] | None = None, prog: str = "meshvisor top") -> int:
    """Run ``meshvisor top`` with the options in `argv`; its exit status."""
    args = _parser(prog).parse_args(argv)
    for signum in (signal.SIGTERM, signal.SIGHUP):  # its terminal closed: clean up, then exit
        signal.signal(signum, _exit_on_signal)
    try:
        target = _target(args)
        meshes = frozenset(args.mesh or ())
        with SnapshotReader(target, listen_host=args.listen_host, meshes=meshes) as reader:
            if args.json:
                return _print_json(reader, args.timeout)
            from observe._live_view import run_live_view

            try:
                run_live_view(reader, args.interval, args.timeout, args.events)
            except KeyboardInterrupt:
                pass
            return 0
    except (TargetError, TransportError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _print_json(reader: SnapshotReader, timeout_s: float) -> int:
    snapshot = reader.take(timeout_s)
    json.dump(snapshot_json(snapshot), sys.stdout, indent=1)
    sys.stdout.write("\n")
    for unreachable in snapshot.unreachable:
        print(f"unreachable {unreachable.agent}: {unreachable.reason}", file=sys.stderr)
    return 1 if snapshot.unreachable else 0


def _target(args: argparse.Namespace) -> Target:
    if args.allocation:
        return allocation_target(args.allocation)
    if args.agent:
        return agents_target(args.agent)
    if args.slurm_job:
        return slurm_target(args.slurm_job, args.job_dir)
    return client_target(args.pid)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Watch what host agents run: hosts, procs, actors, health, CPU, memory, "
        "restarts and the last events, refreshed live (q quits). Read-only: it never owns, "
        "stops or calls anything.",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--pid", type=int, help="a running client on this machine (its pid)")
    which.add_argument("--allocation", help="a persistent allocation (name or file)")
    which.add_argument(
        "--agent", action="append", help="a host agent's address (repeat for several)"
    )
    which.add_argument("--slurm-job", help="a meshvisor SLURM job (id or name)")
    parser.add_argument("--job-dir", help="where the SLURM job's directory is (--slurm-job)")
    parser.add_argument(
        "--mesh",
        action="append",
        help="show only the procs of this proc mesh or actor mesh (repeat for several)",
    )
    parser.add_argument("--json", action="store_true", help="print one snapshot as JSON, exit")
    parser.add_argument(
        "--interval", type=_positive, default=1.0, help="seconds between refreshes (default 1)"
    )
    parser.add_argument(
        "--timeout",
        type=_positive,
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds to wait for each agent's answer (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--events", type=int, default=10, help="how many last events to show (default 10)"
    )
    parser.add_argument(
        "--listen-host",
        default="127.0.0.1",
        help="where this viewer listens for tcp agents' answers (default loopback; give this "
        "machine's address to watch agents on other hosts)",
    )
    return parser


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive, finite number of seconds")
    return value
