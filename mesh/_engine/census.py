"""The actors of a proc as the live view shows them, told to the host agent when they change.

The heartbeat thread asks for the census at each beat and sends `ProcActors` only when it
differs from the last one sent, so a proc whose actors do not change costs the agent nothing
more than its heartbeats.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from mesh._engine.hosted_actor import HostedActor
from mesh._engine.view_messages import ActorView, ProcActors

#: The most actors of one proc the agent is told about (a proc hosts a few in practice).
MAX_ACTORS = 1000
#: The longest failure message kept per actor.
MAX_MESSAGE_CHARS = 300


def actor_census(actors: Iterable[HostedActor]) -> tuple[ActorView, ...]:
    """What the live view shows of each of `actors`: mesh, point, restarts, state, why failed."""
    views = []
    for actor in actors:
        home, event = actor.home, actor.event
        extent = home.rank.extent
        views.append(
            ActorView(
                actor.mesh_name,
                actor.actor_id,
                tuple(extent.labels),
                tuple(extent.sizes),
                home.rank.rank,
                home.restart_count,
                actor.state,
                event.message[:MAX_MESSAGE_CHARS] if event is not None else "",
            )
        )
        if len(views) == MAX_ACTORS:
            break
    return tuple(views)


class CensusReporter:
    """Says what changed in the census of a proc's actors (`hosted`, by id; another thread
    changes it) since the last time it was asked."""

    def __init__(self, proc_id: str, hosted: Mapping[str, HostedActor]) -> None:
        self._proc_id = proc_id
        self._hosted = hosted
        self._last: tuple[ActorView, ...] = ()

    def changed(self) -> ProcActors | None:
        """The message to send if the census changed since the last call, else None (also
        when it cannot be taken now: the heartbeats that call this must go on)."""
        try:
            now = actor_census(list(self._hosted.values()))
        except Exception:
            return None
        if now == self._last:
            return None
        self._last = now
        return ProcActors(self._proc_id, now)
