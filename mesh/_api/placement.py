"""`placement`: where each rank of an actor mesh runs right now (for tools such as chaos)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mesh._api.actor_mesh import ActorMesh


@dataclass(frozen=True)
class Placement:
    """One rank of an actor mesh: its proc, the process running it and its host agent."""

    rank: int  # flat rank within the (sliced) mesh
    proc_id: str  # changes when the rank is re-spawned
    pid: int | None  # None until the proc has started
    agent: str | None  # the address of the host agent it runs under
    state: str  # "starting", "ready", "failed" or "stopped"


def placement(actors: ActorMesh[Any]) -> list[Placement]:
    """Where each rank of `actors` runs now, in rank order."""
    return [
        Placement(rank, peer.proc_id, peer.pid, peer.agent, peer.state)
        for rank, peer in enumerate(actors._peers_in_region())
    ]
