"""The workload of the shipped chaos suite: a ledger of increments kept by a mesh of actors.

Every rank counts the increments it executed. The client records, per process, the increments
that were acknowledged, and how many it attempted without an answer. Whatever chaos does,
an increment is executed at most once: a rank's count is at least what was acknowledged by
that process and at most that plus the unanswered attempts. Async and sync endpoints both
serve, so both dispatch paths are under fire.
"""

from __future__ import annotations

import uuid
from collections import defaultdict

from chaos import Job
from mesh import Actor, endpoint
from supervision import ActorError, RestartPolicy, SupervisionError

POLICY = RestartPolicy(max_restarts=1000, within_s=60.0, backoff_s=0.01)
HEARTBEAT_TIMEOUT_S = 1.0
CALL_TIMEOUT_S = 2.0


class Ledger(Actor):
    """Counts increments; each instance (a restart makes a new one) has its own identity."""

    def __init__(self) -> None:
        self.identity = uuid.uuid4().hex
        self.count = 0

    @endpoint
    def add(self) -> tuple[str, int]:
        self.count += 1
        return self.identity, self.count

    @endpoint
    async def add_async(self) -> tuple[str, int]:
        self.count += 1
        return self.identity, self.count

    @endpoint
    def read(self) -> tuple[str, int]:
        return self.identity, self.count


def ledger(job: Job) -> None:
    procs = job.hosts.spawn_procs(
        per_host={"gpus": 2},
        name="ledger",
        restart=POLICY,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    )
    ranks = job.target(procs.spawn("books", Ledger), heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    flat = ranks.flatten("rank")
    size = len(flat)
    acked: dict[str, int] = defaultdict(int)  # actor -> increments it acknowledged
    seen: dict[str, int] = defaultdict(int)  # actor -> highest count it reported
    unanswered = 0
    regressions: list[str] = []

    def at_most_once() -> bool | str:
        for rank in range(size):
            actor, count = flat.slice(rank=rank).read.call_one().get(timeout=CALL_TIMEOUT_S)
            if not acked[actor] <= count <= acked[actor] + unanswered:
                return (
                    f"rank {rank} (actor {actor}) counted {count}, but {acked[actor]} were "
                    f"acknowledged and {unanswered} went unanswered"
                )
        return True

    job.invariant("every increment executed at most once", at_most_once)
    job.invariant(
        "counts never go backwards", lambda: not regressions or regressions[0], during=True
    )
    job.invariant("the ledger made progress", lambda: sum(acked.values()) > 0)
    step = 0
    while job.running():
        step += 1
        rank = step % size
        adder = flat.slice(rank=rank).add if step % 2 else flat.slice(rank=rank).add_async
        try:
            actor, count = adder.call_one().get(timeout=CALL_TIMEOUT_S)
        except (SupervisionError, ActorError, TimeoutError):
            unanswered += 1
            continue
        acked[actor] += 1
        if count < seen[actor]:
            regressions.append(f"actor {actor} went from {seen[actor]} to {count}")
        seen[actor] = count
