"""The ``meshvisor`` command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

#: Verbs that parse their own options: name -> (module whose `main(argv, prog=)` runs it, help).
#: Each module is imported only when its verb runs, so that ``meshvisor agent`` starts fast.
VERBS: dict[str, tuple[str, str]] = {
    "agent": ("mesh._agent.daemon", "run a host agent"),
    "chaos": ("chaos._cli", "run a workload under fault injection (meshvisor chaos run --help)"),
    "slurm": ("job._cli", "SLURM jobs: batch, cancel, list"),
    "meshes": ("meshvisor._meshes", "detached meshes: list, stop"),
    "sync": ("meshvisor._sync", "copy code to the hosts of an allocation"),
    "logs": ("observe._logs_cli", "show, tail, follow and filter procs' log files"),
    "top": ("observe._top", "watch a running client or allocation live, read-only"),
    "debug": ("observe._debug_cli", "debug calls paused in breakpoint()"),
    "demo": ("meshvisor._demo", "train replicas under random kills"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in VERBS:
        return _run_verb(argv[0], argv[1:])
    parser = argparse.ArgumentParser(prog="meshvisor", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("version", help="print the installed version")
    keys = commands.add_parser("keys", help="create CURVE keys for an allocation")
    keys.add_argument("directory", type=Path, help="where to write them (made private: mode 0700)")
    for verb, (_, text) in VERBS.items():
        commands.add_parser(verb, help=f"{text} (meshvisor {verb} --help)", add_help=False)
    args = parser.parse_args(argv)
    if args.command == "keys":
        return _make_keys(args.directory)
    if args.command == "version":
        from importlib import metadata  # not at the top: every agent starts through here

        print(metadata.version("meshvisor"))
        return 0
    raise AssertionError(f"unhandled command {args.command}")


def _run_verb(verb: str, rest: list[str]) -> int:
    """Run `verb`'s own command line with the arguments after it."""
    if verb == "agent":  # before its imports: a scheduler's notice may come at once
        from mesh.agent_start import hold_early_notices

        hold_early_notices(rest)
    module = importlib.import_module(VERBS[verb][0])
    status = module.main(rest, prog=f"meshvisor {verb}")
    return 0 if status is None else int(status)


def _make_keys(directory: Path) -> int:
    """``meshvisor keys DIR``: a new key pair, private from the start, in a private DIR."""
    from transport import KEYS_ENV, CurveKeys, TransportError

    try:
        CurveKeys.create(directory)
    except TransportError as error:
        print(f"meshvisor keys: {error}", file=sys.stderr)
        return 2
    print(
        f"created CURVE keys in {directory} (mode 0700; the secret key file is 0600); start "
        f"agents with --keys {directory} and clients with {KEYS_ENV}={directory}"
    )
    return 0
