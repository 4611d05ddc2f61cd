"""A SLURM client run as a subprocess by tests/test_slurm_clients.py and test_slurm_cli.py.

``python slurm_client.py start JOB_DIR NAME persistent|transient``: submits a job of two nodes
(mesh ``workers``), spawns a proc per node and calls it, prints ``JOB <id>`` and ``PIDS <json>``
(the procs' pids), then ``READY`` and waits for a line on stdin (at most `WAIT_S`) to exit
normally, so that the test can also SIGKILL it instead.

``python slurm_client.py attach JOB_DIR JOB``: attaches to JOB (id or name), spawns and calls
as above, prints ``JOB``, ``PIDS`` and ``NODES <json>``, and exits.

``python slurm_client.py batch [EXIT_STATUS]``: a batch-mode client (``meshvisor slurm batch``):
gets its meshes with ``SlurmJob.current()``, calls a proc on every node, prints ``NODES`` and
exits with EXIT_STATUS (default 0).
"""

from __future__ import annotations

import faulthandler
import json
import select
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the actors

from actors import Echo

from job import JobState, SlurmJob

WAIT_S = 120.0
T = 60.0
STUCK_S = 75.0  # far more than a client needs to get to READY, or to end


def emit(tag: str, value: object) -> None:
    print(f"{tag} {json.dumps(value)}", flush=True)


def call_every_node(state: JobState, mesh: str) -> None:
    """Spawn one proc per node of `mesh`, call it, and print its pid and node."""
    procs = state[mesh].spawn_procs({"gpus": 1}, name=f"{mesh}-procs")
    echo = procs.spawn("echo", Echo)
    pids = list(echo.pid.call().get(timeout=T).values())
    nodes = list(echo.getenv.call("SLURMD_NODENAME").get(timeout=T).values())
    emit("PIDS", pids)
    emit("NODES", nodes)


def main(argv: list[str]) -> int:
    # a client stuck past its test's bound prints every thread's stack and ends, so the test
    # fails with the evidence (its stderr) instead of waiting on a silent process
    faulthandler.dump_traceback_later(STUCK_S, exit=True)
    verb = argv[0]
    if verb == "start":
        job_dir, name, mode = argv[1:4]
        job = SlurmJob(
            {"workers": 2},
            name=name,
            persistent=mode == "persistent",
            job_dir=job_dir,
            progress=None,
        )
        state = job.state(timeout_s=T)
        emit("JOB", job.job_id)
        call_every_node(state, "workers")
        print("READY", flush=True)
        faulthandler.cancel_dump_traceback_later()
        select.select([sys.stdin], [], [], WAIT_S)
        return 0
    if verb == "attach":
        job = SlurmJob.attach(argv[2], job_dir=argv[1], progress=None)
        state = job.state(timeout_s=T)
        emit("JOB", job.job_id)
        call_every_node(state, "workers")
        return 0
    if verb == "batch":
        state = SlurmJob.current(progress=None).state(timeout_s=T)
        for mesh in state.meshes:
            call_every_node(state, mesh)
        return int(argv[1]) if len(argv) > 1 else 0
    raise SystemExit(f"unknown verb {verb!r}: start, attach or batch")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
