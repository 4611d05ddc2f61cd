"""The replicas of a `ReplicaGroup` as its controller sees them: how one is spawned (members
and spares alike, the same way) and what the group tracks about each member."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mesh import ActorMesh, Future, HostMesh, ProcMesh, ValueMesh
from mesh.tooling import any_done
from supervision import ActorError, SupervisionError, SupervisionEvent

from ._build import SPARE_ENV
from ._outcomes import Recovery
from ._replica import Replica
from ._spares import SparePool

#: What a replica's proc needs imported, the fork server imports before forking it (once per
#: host): torch, torch._dynamo that the optimizers import on their first step, and this
#: package, which a `Replica` subclass's module imports (~0.3 s of a replacement's start).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "recovery")

#: glibc's malloc settings for a replica's procs (``GLIBC_TUNABLES``, which a proc applies as
#: it starts): big tensors (gradients, optimizer temporaries) come from one heap kept step
#: after step, instead of being mapped afresh and faulted in a page at a time at every step
#: (two 4096 x 4096 layers with Adam: 98 thousand page faults and 430-480 ms of CPU per step,
#: against none and 270 ms). The client's own ``GLIBC_TUNABLES`` (even empty) is kept instead.
TENSOR_MALLOC = (
    "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=2147483647:"
    "glibc.malloc.arena_max=1"
)


def replica_env(preload: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a replica's procs: `env`, what the fork server preloads, and
    `TENSOR_MALLOC` unless the client or `env` chose its own malloc settings."""
    chosen = dict(env or {})
    if preload:
        chosen.setdefault("MESHVISOR_PRELOAD", ",".join(preload))
    if "GLIBC_TUNABLES" not in os.environ:
        chosen.setdefault("GLIBC_TUNABLES", TENSOR_MALLOC)
    return chosen


#: Told of every failure of a replica's meshes, with the proc mesh it concerns.
FailureHandler = Callable[[ProcMesh, SupervisionEvent], bool]


@dataclass
class Member:
    """Replica `index` of the group: its meshes (a spare's, once one took its place)."""

    index: int
    procs: ProcMesh
    actors: ActorMesh[Replica]
    state: str = "live"  # live | failed | closed
    respawn: Future[None] | None = None
    up: Future[Any] | None = None  # done once the replacement runs (configured)
    healing: Future[Any] | None = None  # the replacement's heal, while the others step
    recovery: Recovery | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    host_lost: bool = False  # its last failure was the loss of its host


@dataclass(frozen=True, eq=False)
class ReplicaSpawner:
    """Spawns one replica (a proc mesh of `per_replica` ranks holding the replica actor) the
    way the group's every replica is spawned, and routes its failures to `on_failure`."""

    hosts: HostMesh
    replica_class: type[Replica]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    per_replica: Mapping[str, int]
    preload: Sequence[str]  # modules the fork server imports before forking its procs
    heartbeat_timeout_s: float | None
    spare_hosts: SparePool  # where a replica whose host is lost goes (one host each, once)
    on_failure: FailureHandler

    def spawn(
        self, name: str, slot: int, spare: bool = False
    ) -> tuple[ProcMesh, ActorMesh[Replica]]:
        """Replica meshes named after `name`, on the host of `slot` (round robin over the
        hosts), a spare's if `spare`; returns at once, the procs start in the background."""
        where = self.hosts
        if "hosts" in where.extent.labels:
            count = where.extent.sizes[where.extent.labels.index("hosts")]
            where = where.slice(hosts=slot % count)
        procs = where.spawn_procs(
            per_host=dict(self.per_replica),
            name=f"{name}-procs",
            env=replica_env(self.preload, {SPARE_ENV: "1"} if spare else None),
            heartbeat_timeout_s=self.heartbeat_timeout_s,
        )
        try:
            actors = procs.spawn(name, self.replica_class, *self.args, **self.kwargs)
        except BaseException:  # (an argument that cannot be sent, say): its procs go too
            with contextlib.suppress(Exception):
                procs.stop(grace_s=1.0).get(timeout=10.0)
            raise
        handler = _Routed(self.on_failure, procs)
        procs.on_failure(handler)
        actors.on_failure(handler)
        return procs, actors


@dataclass(frozen=True)
class _Routed:
    """A failure handler of one replica's meshes: tells `handler` which proc mesh failed, so
    the group finds who holds it now (a member, a spare, or no one any more)."""

    handler: FailureHandler
    procs: ProcMesh

    def __call__(self, event: SupervisionEvent) -> bool:
        return self.handler(self.procs, event)


#: `gather` asks its `until` as each call ends, and at least this often.
UNTIL_POLL_S = 0.01


def failures(results: Mapping[int, Any]) -> dict[int, BaseException]:
    """The members whose call failed, with the error, out of `gather`'s `results`."""
    return {i: e for i, e in results.items() if isinstance(e, BaseException)}


def gather(
    calls: Mapping[int, Future[ValueMesh[Any]]],
    timeout_s: float,
    until: Callable[[Mapping[int, Any]], bool] | None = None,
) -> dict[int, Any]:
    """Wait for the call made to each member (all within `timeout_s`): per member, the list
    of values (rank order) or the error. If `until(the calls done so far)` turns true first,
    returns at once with those (the calls under way are left out)."""
    deadline = time.monotonic() + timeout_s
    if until is not None:
        while time.monotonic() < deadline:
            done = {i: _outcome(f, 0.0) for i, f in calls.items() if f.done()}
            if len(done) == len(calls) or until(done):
                return done
            pending = [f for f in calls.values() if not f.finished()]
            try:  # receives the replies meanwhile: wakes as one of the calls ends
                any_done(pending, "one of the calls").get(timeout=UNTIL_POLL_S)
            except TimeoutError:
                pass
    results: dict[int, Any] = {}
    for index, future in calls.items():
        results[index] = _outcome(future, max(0.0, deadline - time.monotonic()))
    return results


def _outcome(future: Future[ValueMesh[Any]], timeout_s: float) -> Any:
    """The values of a member's call (rank order) or its error, waiting up to `timeout_s`."""
    try:
        return list(future.get(timeout=timeout_s).values())
    except (SupervisionError, ActorError, TimeoutError) as exc:
        return exc


def commit_digests(
    committed: dict[int, Any], members: int, call_all: Callable[..., dict[int, Any]], step: int
) -> set[str]:
    """The digests that the `members` participants' commits of `step` returned: whole ones
    (one unless they diverged), or the one they returned a share each of (`digest_part`: the
    first rank's of each). A share lost with a participant that died while committing is made
    up by asking a participant whose commit succeeded for its whole digest (`call_all`), so
    that the spares and replacements checked at that step are not healed whole for it."""
    from ._arithmetic import combine_digest

    shares = {
        i: v[0]
        for i, v in committed.items()
        if isinstance(v, list) and v and isinstance(v[0], list)
    }
    if not shares:
        return {d for v in committed.values() if isinstance(v, list) for d in v if d}
    if len(shares) < members:
        found = _whole_digest(call_all, next(iter(shares)), step)
        return {found} if found else set()
    return {combine_digest(entry for share in shares.values() for entry in share)}


def _whole_digest(call_all: Callable[..., dict[int, Any]], index: int, step: int) -> str | None:
    """Member `index`'s whole digest (its first rank's) if it is still at committed `step`."""
    found = call_all((index,), "status").get(index)
    if isinstance(found, list) and found and found[0][0] == step:
        return str(found[0][1])
    return None
