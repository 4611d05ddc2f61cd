"""A meshvisor client run as a subprocess by tests/test_replicas.py: trains a `ReplicaGroup`
where numpy cannot be imported, to show that torch alone is enough for the replica toolkit.

The test puts a ``sitecustomize.py`` first on ``PYTHONPATH`` that makes ``import numpy`` fail,
in this client and in every process started with its environment (the host agent, its fork
server, the procs). Prints ``RESULT <json>``: whether numpy was importable here and in a proc,
the replicas' digests after a replica was killed and healed, and the digest of a replay.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the replicas

import replica_actors as ra

from mesh import Actor, endpoint, this_host
from mesh.testing import probe
from recovery import ReplicaGroup, parameter_digest, replay_training

T = 60.0


def numpy_importable() -> bool:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


class NumpyProbe(Actor):
    """Says whether numpy can be imported in its proc."""

    @endpoint
    def importable(self) -> bool:
        return numpy_importable()


def main() -> None:
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="probe")
    in_proc = procs.spawn("numpy", NumpyProbe).importable.call_one().get(timeout=T)
    procs.stop().get(timeout=T)
    group = ReplicaGroup(this_host(), ra.Trainer, replicas=2, min_replicas=1, heartbeat_timeout_s=T)
    try:
        for _ in range(2):
            group.step()
        victim = int(next(iter(probe(group.replicas[1]).get(timeout=T).values())))
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + T
        while not group.recoveries or group.recoveries[-1].first_commit_at is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica 1 did not heal within {T} s: {group.recoveries}")
            group.step()
        group.wait_for_all(T)
        digests = sorted({d for entries in group.status().values() for _, d in entries})
        replayed = parameter_digest(replay_training(ra.Trainer, group.history))
        result = {
            "numpy_here": numpy_importable(),
            "numpy_in_proc": in_proc,
            "consistency": group.check_consistency(),
            "digests": digests,
            "replayed": replayed,
            "healed": len(group.recoveries),
        }
    finally:
        group.close()
    print(f"RESULT {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
