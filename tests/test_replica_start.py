"""A replica group's start-up: a replica that fails while the group starts is replaced like
any other failure, and replicas are forked from a fork server that has torch loaded already
(it imports what a proc's MESHVISOR_PRELOAD names, once, before forking it)."""

from __future__ import annotations

import sys
from pathlib import Path

import exchange_actors as xa
import pytest
import replica_actors as ra

from mesh import Actor, endpoint, this_host
from mesh.testing import probe
from recovery import ReplicaGroup, replay_training
from recovery import parameter_digest as digest

pytestmark = pytest.mark.timeout(240)


def test_a_replica_hanging_while_the_group_starts_is_replaced(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    group = ReplicaGroup(
        this_host(), xa.HangsWhileBuilt, str(tmp_path), replicas=3, heartbeat_timeout_s=1.0
    )
    groups.append(group)
    assert [r.event for r in group.recoveries if "hung" in r.event], group.recoveries
    while group.committed_steps < 3 or group.recoveries[-1].first_commit_at is None:
        group.step()
        assert len(group.outcomes) < 500, group.outcomes[-5:]
    assert group.live() == (0, 1, 2)
    replayed = replay_training(ra.Trainer, group.history)
    assert {d for entries in group.status().values() for _, d in entries} == {digest(replayed)}


class Modules(Actor):
    @endpoint
    def loaded(self, name: str) -> bool:
        return name in sys.modules


def loaded_in_new_proc(name: str, env: dict[str, str] | None) -> bool:
    procs = this_host().spawn_procs(per_host={"p": 1}, name="preload", env=env)
    try:
        found = procs.spawn("modules", Modules).loaded.call(name).get(timeout=60)
        return bool(next(iter(found.values())))
    finally:
        procs.stop(grace_s=1.0).get(timeout=30)


def test_the_fork_server_preloads_what_a_procs_env_names() -> None:
    module = "tabnanny"  # imported by nothing meshvisor or torch loads
    assert not loaded_in_new_proc(module, None)
    assert loaded_in_new_proc(module, {"MESHVISOR_PRELOAD": f"{module}, no_such_module_here"})
    assert loaded_in_new_proc(module, None), "the fork server keeps what it imported"


def test_replicas_are_forked_with_torch_loaded(groups: list[ReplicaGroup]) -> None:
    group = ReplicaGroup(this_host(), ra.Trainer, replicas=2)
    groups.append(group)
    pid = int(next(iter(probe(group.replicas[0]).get(timeout=30).values())))
    status = Path(f"/proc/{pid}/status").read_text()
    parent = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid")))
    maps = Path(f"/proc/{parent}/maps").read_text()  # the fork server's own memory
    assert "libtorch" in maps, "the fork server imported torch before forking the replicas"
