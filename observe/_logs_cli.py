"""``meshvisor logs``: show, tail, follow and filter the per-rank log files of a run.

Which run: ``--job`` (a SLURM job's directory), ``--allocation`` (a persistent allocation's),
``--run`` (a name under the logs home, ``--list`` shows them), ``--dir``, else the run whose
directory changed last. Records of all ranks are merged in time order and shown as the client
shows lines.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from mesh.tooling import ALLOCATION_PREFIX, LEVELS, logs_home
from observe._logs_read import (
    Follower,
    LogFilter,
    LogsError,
    Offsets,
    Record,
    as_json,
    merged_records,
    shown,
)

#: How often ``--follow`` looks for new lines.
FOLLOW_INTERVAL_S = 0.2
#: How many lines ``--follow`` shows first when -n is not given (as ``tail -f``).
FOLLOW_TAIL = 10


def main(argv: list[str] | None = None, prog: str = "meshvisor logs") -> int:
    """Run ``meshvisor logs``; its exit status (1 with a message on stderr on an error)."""
    args = _parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.list:
            return _list_runs()
        directory = log_directory(args)
        keep = _filter(args)
        return _show(directory, keep, args)
    except LogsError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # e.g. piped into head
        sys.stderr.close()
        return 0


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--job", help="a SLURM job (id or name) started by meshvisor")
    where.add_argument("--allocation", help="a persistent allocation (name or file)")
    where.add_argument("--run", help="a run's directory name under the logs home (see --list)")
    where.add_argument("--dir", type=Path, help="a log directory (an agent's --log-dir)")
    where.add_argument("--list", action="store_true", help="list the runs with log files")
    parser.add_argument("--mesh", help="only the procs of this proc mesh")
    parser.add_argument(
        "--rank",
        action="append",
        default=[],
        help="only this rank: a flat rank (3) or coordinates (hosts=0,gpus=1); repeatable",
    )
    parser.add_argument("--level", help=f"only lines at this level or above: {', '.join(LEVELS)}")
    parser.add_argument("--since", help="only lines from then on: 10m, 2h, 30s, 1d, or a time")
    parser.add_argument("--until", help="only lines until then (same forms as --since)")
    parser.add_argument("-n", "--lines", type=int, default=None, help="only the last N lines")
    parser.add_argument("-f", "--follow", action="store_true", help="keep showing new lines")
    parser.add_argument("-t", "--time", action="store_true", help="show each line's time, level")
    parser.add_argument("--json", action="store_true", help="print the records as JSON lines")
    return parser


def log_directory(args: argparse.Namespace) -> Path:
    """The log directory the options name; LogsError saying why there is none."""
    home = logs_home()
    if args.dir is not None:
        return _existing(args.dir, f"log directory {args.dir}")
    if args.job is not None:
        return _job_logs(args.job)
    if args.allocation is not None:
        name = Path(args.allocation).name
        found = home / f"{ALLOCATION_PREFIX}{name}"
        return _existing(found, f"allocation {args.allocation!r} has no log directory {found}")
    if args.run is not None:
        return _existing(home / args.run, f"run {args.run!r} has no log directory in {home}")
    runs = _runs(home)
    if not runs:
        raise LogsError(f"no run has kept log files in {home} yet")
    print(f"{runs[-1]}:", file=sys.stderr, flush=True)
    return runs[-1]


def _existing(path: Path, what: str) -> Path:
    if not path.is_dir():
        hint = "" if path.parent.is_dir() else f" ({path.parent} does not exist)"
        raise LogsError(
            f"{what} not found{hint}: procs keep log files once they ran; "
            "'meshvisor logs --list' lists the runs"
        )
    return path


def _job_logs(job: str) -> Path:
    from job._jobdir import job_dirs_matching

    try:
        found = job_dirs_matching(job)[0]
    except LookupError as error:
        raise LogsError(str(error)) from None
    return _existing(found.logs_dir, f"the log directory of job {job!r}, {found.logs_dir},")


def _runs(home: Path) -> list[Path]:
    """The log directories under `home`, the one written last at the end."""
    try:
        found = [path for path in home.iterdir() if path.is_dir()]
    except OSError:
        return []
    return sorted(found, key=lambda path: path.stat().st_mtime)


def _list_runs() -> int:
    home = logs_home()
    for path in _runs(home):
        stamp = datetime.fromtimestamp(path.stat().st_mtime).isoformat(timespec="seconds")
        print(f"{stamp}  {path.name}")
    return 0


def _filter(args: argparse.Namespace) -> LogFilter:
    if args.lines is not None and args.lines < 0:
        raise LogsError(f"-n must be a number of lines >= 0, not {args.lines}")
    return LogFilter.from_options(args.mesh, args.rank, args.level, args.since, args.until)


def _show(directory: Path, keep: LogFilter, args: argparse.Namespace) -> int:
    offsets: Offsets = {}
    records, meshes = merged_records(directory, keep, offsets)
    if keep.mesh is not None and keep.mesh not in meshes and not args.follow:
        there = ", ".join(sorted(meshes)) or "none"
        raise LogsError(f"no proc of mesh {keep.mesh!r} wrote to {directory} (meshes: {there})")
    limit = args.lines if args.lines is not None else (FOLLOW_TAIL if args.follow else None)
    _print(deque(records, maxlen=limit) if limit is not None else records, args)
    follower = Follower(directory, keep, offsets)
    while args.follow:
        time.sleep(FOLLOW_INTERVAL_S)
        _print(follower.new_records(), args)
    return 0


def _print(records: Iterable[Record], args: argparse.Namespace) -> None:
    for record in records:
        sys.stdout.write((as_json(record) if args.json else shown(record, args.time)) + "\n")
    sys.stdout.flush()
