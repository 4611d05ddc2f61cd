"""The ``meshvisor`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshvisor", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("version", help="print the installed version")
    commands.add_parser(
        "agent", help="run a host agent (options: meshvisor agent --help)", add_help=False
    )
    commands.add_parser(
        "chaos",
        help="run a workload under fault injection (meshvisor chaos run --help)",
        add_help=False,
    )
    commands.add_parser(
        "slurm",
        help="SLURM jobs: batch, cancel, list (meshvisor slurm --help)",
        add_help=False,
    )
    keys = commands.add_parser("keys", help="create CURVE keys for an allocation")
    keys.add_argument("directory", type=Path, help="where to write them (made private: mode 0700)")
    commands.add_parser(
        "demo",
        help="train replicas under random kills (meshvisor demo --help)",
        add_help=False,
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["agent"]:  # the agent parses its own options
        return _run_agent(argv[1:])
    if argv[:1] == ["chaos"]:
        return _run_chaos(argv[1:])
    if argv[:1] == ["demo"]:
        return _run_demo(argv[1:])
    if argv[:1] == ["slurm"]:
        return _run_slurm(argv[1:])
    args, rest = parser.parse_known_args(argv)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "keys":
        return _make_keys(args.directory)
    if args.command == "version":
        from importlib import metadata  # not at the top: every agent starts through here

        print(metadata.version("meshvisor"))
        return 0
    raise AssertionError(f"unhandled command {args.command}")


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


def _run_agent(rest: list[str]) -> int:
    from mesh._agent.daemon import main as agent_main

    agent_main(rest, prog="meshvisor agent")
    return 0


def _run_chaos(rest: list[str]) -> int:
    from chaos._cli import main as chaos_main

    return chaos_main(rest, prog="meshvisor chaos")


def _run_demo(rest: list[str]) -> int:
    """TorchFT-style replica training under the chaos harness (meshvisor/_demo.py)."""
    from meshvisor._demo import main as demo_main

    return demo_main(rest, prog="meshvisor demo")


def _run_slurm(rest: list[str]) -> int:
    """SLURM jobs from the shell: batch mode, cancel, list (job/_cli.py)."""
    from job._cli import main as slurm_main

    return slurm_main(rest, prog="meshvisor slurm")
