"""Host meshes from SLURM: allocate, call, lose a node, come back on the spare, get a notice.

    python examples/slurm_job.py

With ``SLURM_CONF`` pointing at a cluster (or SLURM configured on this machine) it uses that
cluster; otherwise it starts a private 4-node cluster on this machine (`job.testing`, needs
Debian's slurmctld/slurmd/munge: tests/install-system-packages), where it can also kill a node
to show what node loss looks like. Everything it starts is cancelled or stopped at the end.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator

from job import SlurmJob
from job.testing import LocalSlurmCluster
from mesh import Actor, endpoint
from supervision import SupervisionError, SupervisionEvent


class Worker(Actor):
    @endpoint
    def node(self) -> str:
        return os.environ.get("SLURMD_NODENAME", "?")


@contextlib.contextmanager
def cluster() -> Iterator[LocalSlurmCluster | None]:
    """The user's SLURM if there is one, else a private local cluster for this run."""
    if os.environ.get("SLURM_CONF") or os.path.exists("/etc/slurm/slurm.conf"):
        yield None
        return
    with LocalSlurmCluster(4) as local:
        os.environ.update(local.env)
        yield local


def main() -> None:
    with cluster() as local:
        started = time.monotonic()
        job = SlurmJob({"trainers": 3, "spare": 1}, name="example", time_limit=30 * 60)
        try:
            state = job.state(timeout_s=120)
            procs = state.trainers.spawn_procs({"gpus": 1}, name="workers")
            workers = procs.spawn("worker", Worker)
            print("ranks run on", list(workers.node.call().get(timeout=60).values()))
            print(f"first call answered {time.monotonic() - started:.1f} s after SlurmJob()")

            events: list[SupervisionEvent] = []
            procs.on_failure(lambda event: events.append(event) or True)

            if local is not None:  # only on our own cluster: kill node n2 as a lost machine
                lost = time.monotonic()
                local.kill_node(state.nodes["trainers"][1])
                try:
                    workers.node.call().get(timeout=60)
                except SupervisionError as error:
                    print(f"node loss seen after {time.monotonic() - lost:.2f} s: {error}")
                procs.respawn(on=state.spare).get(timeout=60)
                print(
                    "after re-spawn on the spare:",
                    list(workers.node.call().get(timeout=60).values()),
                )

            # SLURM sends the warning signal (--signal=USR1@60) before a time limit or a
            # preemption; scancel --signal does the same by hand.
            subprocess.run(["scancel", "--signal=USR1", str(job.job_id)], check=True)
            deadline = time.monotonic() + 30
            while not any(e.kind == "preempting" for e in events) and time.monotonic() < deadline:
                time.sleep(0.1)
            notices = [e for e in events if e.kind == "preempting"]
            if notices:
                print(f"preemption notice: {notices[0].time_left_s} s left: drain and save now")
            procs.stop().get(timeout=60)
        finally:
            job.cancel()
        print("job", job.job_id, "cancelled:", job.slurm_state())


if __name__ == "__main__":
    main()
