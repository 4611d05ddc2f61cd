"""Workloads for the chaos tests: actor jobs that keep working through faults."""

from __future__ import annotations

from chaos import Job
from mesh import Actor, endpoint
from supervision import ActorError, RestartPolicy, SupervisionError

#: Restart whatever fails, as often as chaos likes: the harness checks the healing.
FOREVER = RestartPolicy(max_restarts=1000, within_s=60.0)
HEARTBEATS = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0}


class Counter(Actor):
    """Counts its calls; a restart starts again from zero."""

    def __init__(self) -> None:
        self.count = 0

    @endpoint
    def incr(self) -> int:
        self.count += 1
        return self.count

    @endpoint
    async def incr_async(self) -> int:
        self.count += 1
        return self.count


def counters(job: Job) -> None:
    """Two ranks per host, restarted by policy; calls go on through every fault."""
    procs = job.hosts.spawn_procs(
        per_host={"gpus": 2}, name="workers", restart=FOREVER, **HEARTBEATS
    )
    actors = job.target(procs.spawn("counters", Counter), heartbeat_timeout_s=1.0)
    done = {"ok": 0, "failed": 0}
    job.invariant("the workload made progress", lambda: done["ok"] > 0 or "no call succeeded")
    while job.running():
        try:
            actors.incr.call().get(timeout=2.0)
            done["ok"] += 1
        except (SupervisionError, ActorError, TimeoutError):
            done["failed"] += 1
        job.sleep(0.005)
