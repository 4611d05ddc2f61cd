"""``meshvisor chaos run SCRIPT ...`` (also ``python -m chaos run ...``): a chaos run from the
command line, with a live display, the report, and exit status 0 only if every invariant held.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from job.testing import LocalSlurmCluster, SlurmNotInstalled

from ._errors import ChaosSetupError
from ._faults import FAULT_KINDS
from ._harness import check_fits_allocation, run_chaos
from ._options import ChaosOptions
from ._render import render
from ._report import RunReport
from ._schedule import RandomSchedule


def build_parser(prog: str = "meshvisor chaos") -> argparse.ArgumentParser:
    """The command line of ``meshvisor chaos`` (and ``python -m chaos``), which also parses the
    replay line of a report."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run a workload under a seeded random fault schedule",
        description="Run SCRIPT's workload function (def workload(job)) on a fresh local "
        "allocation (or a SLURM job, --slurm) while injecting random faults, then print the "
        "report.",
    )
    run.add_argument("script", help="FILE.py or FILE.py:FUNCTION (default function: workload)")
    run.add_argument("--seed", type=int, default=0, help="the schedule's seed (default 0)")
    run.add_argument("--mtbf", type=float, default=2.0, help="mean seconds between faults")
    run.add_argument(
        "--faults",
        default="kill,pause",
        help="the fault mix: kinds, optionally weighted, e.g. kill:3,pause,drop "
        f"(kinds: {', '.join(FAULT_KINDS)})",
    )
    run.add_argument("--duration", type=float, default=20.0, help="seconds of faults")
    run.add_argument("--warmup", type=float, default=1.0, help="seconds before the first fault")
    run.add_argument("--max-concurrent", type=int, default=1, help="faults at the same time")
    run.add_argument("--hosts", type=int, default=2, help="hosts (local agents) to run on")
    run.add_argument(
        "--slurm",
        choices=("local", "env"),
        default=None,
        help="run the hosts on SLURM nodes: 'local' starts a private SLURM cluster on this "
        "machine for the run, 'env' uses the SLURM of the environment (SLURM_CONF); allows "
        "the faults kill_node and preempt",
    )
    run.add_argument("--partition", default=None, help="with --slurm: the SLURM partition")
    run.add_argument("--heal-timeout", type=float, default=30.0, help="seconds to heal a fault")
    run.add_argument(
        "--detect-timeout", type=float, default=15.0, help="seconds for a fault to be noticed"
    )
    run.add_argument("--report", type=Path, default=None, help="write the JSON report here")
    run.add_argument(
        "--verbose", action="store_true", help="show the output of the workload's processes"
    )
    return parser


def main(argv: list[str] | None = None, prog: str = "meshvisor chaos") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        schedule = RandomSchedule.from_mix(
            args.seed,
            args.mtbf,
            args.duration,
            args.faults,
            warmup_s=args.warmup,
            max_concurrent=args.max_concurrent,
        )
    except ValueError as exc:
        parser.error(str(exc))
    options = ChaosOptions(
        hosts=args.hosts,
        heal_timeout_s=args.heal_timeout,
        detect_timeout_s=args.detect_timeout,
        verbose=args.verbose,
        slurm="env" if args.slurm else None,
        slurm_partition=args.partition,
    )
    try:
        check_fits_allocation(schedule, options)
    except ChaosSetupError as exc:
        parser.error(str(exc))
    console = Console(stderr=False)
    try:
        with _slurm_for_the_run(args, options):
            report = _run_with_display(args, schedule, options, console)
    except (ChaosSetupError, SlurmNotInstalled) as exc:
        console.print(f"[red]chaos run could not start:[/red] {exc}", markup=True)
        return 2
    render(report, console)
    if args.report is not None:
        report.to_json(args.report)
        console.print(f"report written to {args.report}")
    return 0 if report.ok else 1


@contextlib.contextmanager
def _slurm_for_the_run(args: argparse.Namespace, options: ChaosOptions) -> Iterator[None]:
    """With ``--slurm local``: a private SLURM cluster (one node per host, and one for the
    job's batch script) that SLURM's commands use while the run lasts, removed after it."""
    if args.slurm != "local":
        yield
        return
    with LocalSlurmCluster(args.hosts + 1) as cluster:
        saved = {name: os.environ.get(name) for name in cluster.env}
        os.environ.update(cluster.env)
        options.slurm = cluster
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _run_with_display(
    args: argparse.Namespace, schedule: RandomSchedule, options: ChaosOptions, console: Console
) -> RunReport:
    """Run, showing a progress bar over the fault period and a line per fault."""
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task(f"chaos (seed {args.seed})", total=args.duration)
        started = threading.Event()
        stop = threading.Event()

        def on_update(line: str) -> None:
            started.set()
            progress.console.print(line, markup=False, highlight=False)

        def tick() -> None:
            started.wait()
            begin = time.monotonic()
            while not stop.wait(0.2):
                elapsed = min(time.monotonic() - begin, args.duration)
                progress.update(task, completed=elapsed)

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        options.on_update = on_update
        try:
            return run_chaos(args.script, schedule, options)
        finally:
            stop.set()
            started.set()


if __name__ == "__main__":
    sys.exit(main())
