"""``meshvisor slurm``: batch mode (a client script in its own allocation), cancel and list.

- ``meshvisor slurm batch --mesh trainers=4 [SLURM options] SCRIPT [ARGS...]`` submits one job
  whose first node runs SCRIPT (it gets its meshes with ``SlurmJob.current().state()``); the
  job ends when the script does, and SLURM records its exit status.
- ``meshvisor slurm cancel JOB`` ends a job by SLURM id or name.
- ``meshvisor slurm list`` shows every job of the job directory with SLURM's state; ``--prune``
  removes the directories of jobs SLURM has forgotten.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

from job._formats import LIVE_JOB_STATES, parse_duration
from job._jobdir import JobDir, JobSpec, all_job_dirs, jobs_home
from job._scheduler import SlurmError, job_states
from job._slurm_job import SlurmJob, find_job

#: What `list` shows for a job SLURM no longer knows (it ended more than MinJobAge ago).
FORGOTTEN = "FORGOTTEN"


def main(argv: list[str] | None = None, prog: str = "meshvisor slurm") -> int:
    """Run one ``meshvisor slurm`` verb; its exit status (1 with a message on an error)."""
    args = _parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    try:
        status: int = args.run(args)
    except (SlurmError, LookupError, ValueError, OSError) as error:
        print(f"{prog} {args.verb}: {error}", file=sys.stderr)
        return 1
    return status


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    batch = verbs.add_parser("batch", help="run a client script in a job of its own")
    batch.add_argument(
        "--mesh",
        action="append",
        required=True,
        metavar="NAME=N",
        help="a mesh of N nodes (repeat for several; the script runs on the first node)",
    )
    for option in ("partition", "account", "qos", "mem"):
        batch.add_argument(f"--{option}", help=f"SLURM's --{option}")
    batch.add_argument("--time", help="SLURM's time limit (e.g. 30, 1:00:00, 2-00:00:00)")
    batch.add_argument("--gpus-per-node", type=int)
    batch.add_argument("--cpus-per-task", type=int)
    batch.add_argument("--exclusive", action="store_true")
    batch.add_argument(
        "--slurm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra sbatch argument, e.g. --slurm-arg=--constraint=a100 (repeatable)",
    )
    batch.add_argument("--job-name", help="the job's name (default: the script's)")
    batch.add_argument("script", metavar="SCRIPT", help="a Python file or an executable")
    batch.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    batch.set_defaults(run=_batch)
    cancel = verbs.add_parser("cancel", help="cancel a job by SLURM id or name")
    cancel.add_argument("job", metavar="JOB", help="SLURM job id or name")
    cancel.set_defaults(run=_cancel)
    listing = verbs.add_parser("list", help="list the jobs with SLURM's state")
    listing.add_argument(
        "--prune", action="store_true", help="remove the directories of jobs SLURM forgot"
    )
    listing.set_defaults(run=_list)
    for verb in (batch, cancel, listing):
        verb.add_argument(
            "--job-dir", type=Path, help="where job directories are (default ~/.meshvisor/slurm)"
        )
    return parser


def _batch(args: argparse.Namespace) -> int:
    meshes = dict(_mesh(text) for text in args.mesh)
    if args.time is not None:
        parse_duration(args.time)  # a clear error now rather than sbatch's
    script = Path(args.script)
    if not script.is_file() and shutil.which(args.script) is None:
        raise ValueError(f"the client script {args.script} does not exist")
    if script.is_file():
        script = script.resolve()
    command = [sys.executable] if script.suffix == ".py" else []
    command += [str(script) if script.is_file() else args.script, *args.script_args]
    job = SlurmJob(
        meshes,
        name=args.job_name or _job_name(script.stem),
        partition=args.partition,
        time_limit=args.time,
        gpus_per_node=args.gpus_per_node,
        cpus_per_task=args.cpus_per_task,
        mem=args.mem,
        account=args.account,
        qos=args.qos,
        exclusive=args.exclusive,
        slurm_args=args.slurm_arg,
        progress=None,
        job_dir=args.job_dir,
    ).apply(script=command)
    print(f"submitted SLURM job {job.job_id} ({job.name})")
    print(f"the client runs on its first node; output in {job.output_file}")
    print(f"follow it: tail -f {job.output_file}; end it: meshvisor slurm cancel {job.job_id}")
    return 0


def _cancel(args: argparse.Namespace) -> int:
    job = find_job(args.job, job_dir=args.job_dir, progress=None)
    state = job.slurm_state()
    if state not in LIVE_JOB_STATES:
        print(f"SLURM job {job.job_id} ({job.name}) had already ended ({state})")
        return 0
    job.cancel()
    print(f"cancelled SLURM job {job.job_id} ({job.name}), now {job.slurm_state()}")
    return 0


def _list(args: argparse.Namespace) -> int:
    root = args.job_dir or jobs_home()
    rows: list[tuple[JobDir, JobSpec]] = []
    for found in all_job_dirs(root):
        try:
            rows.append((found, found.read_spec()))
        except (ValueError, TypeError):
            continue  # not a job's directory (or half written)
    states = job_states([spec.job_id for _, spec in rows if spec.job_id])
    table = [("NAME", "JOB ID", "STATE", "MESHES", "PERSISTENT", "DIRECTORY")]
    pruned = []
    for found, spec in rows:
        state = states.get(spec.job_id or "", FORGOTTEN)
        if args.prune and state == FORGOTTEN:
            shutil.rmtree(found.path, ignore_errors=True)
            pruned.append(f"{spec.name} ({spec.job_id})")
            continue
        meshes = ",".join(f"{name}={count}" for name, count in spec.meshes.items())
        kind = "batch" if spec.script else "yes" if spec.persistent else "no"
        table.append((spec.name, spec.job_id or "-", state, meshes, kind, str(found.path)))
    if len(table) == 1:
        print(f"no meshvisor SLURM jobs in {root}")
    else:
        widths = [max(len(row[k]) for row in table) for k in range(len(table[0]) - 1)]
        for row in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1])
    if pruned:
        print(f"pruned {len(pruned)} jobs SLURM forgot: {', '.join(pruned)}")
    return 0


def _mesh(text: str) -> tuple[str, int]:
    name, _, count = text.partition("=")
    if not name.isidentifier() or not count.isdigit() or int(count) < 1:
        raise ValueError(f"--mesh {text!r} must be NAME=N, e.g. --mesh trainers=4")
    return name, int(count)


def _job_name(stem: str) -> str:
    """A SLURM job name from a script's name (letters, digits, '_', '.', '-'; at most 64)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", stem)[:64] or "meshvisor"
