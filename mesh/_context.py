"""Who is running: the actor, rank and mesh of the message being handled right now."""

from __future__ import annotations

import contextvars
import os
from dataclasses import dataclass

from mesh._settings import current_settings
from mesh._shape import Extent, Point


@dataclass(frozen=True)
class Context:
    """The running context. `actor_id` names this actor (its mesh and rank); in the client it
    is None and `rank` is the empty point."""

    actor_id: str | None
    mesh_name: str | None
    rank: Point
    proc_id: str
    host: str
    pid: int
    restart_count: int = 0  # how many times this actor was rebuilt after a failure


_EMPTY_POINT = Point((), Extent((), ()))
_current: contextvars.ContextVar[Context] = contextvars.ContextVar("meshvisor_context")


def actor_identity(mesh_id: str, rank: int) -> str:
    """The id of the actor at flat `rank` of the actor mesh `mesh_id`: one per actor, kept
    when the actor is rebuilt after a failure (`Context.restart_count` tells them apart)."""
    return f"{mesh_id}[{rank}]"


def client_context() -> Context:
    """The client's context: its host is named as its agents name theirs (`Settings.host_name`,
    on SLURM the node's name), so that a client on a node and that node's procs agree."""
    host = current_settings().host_name
    return Context(None, None, _EMPTY_POINT, "client", host, os.getpid())


def context() -> Context:
    """The context of the running actor message (or of the client outside actors)."""
    try:
        return _current.get()
    except LookupError:
        return client_context()


def current_rank() -> Point:
    """This actor's point in the mesh the current message was sent to."""
    return context().rank


def current_size() -> dict[str, int]:
    """The sizes of the mesh the current message was sent to."""
    return dict(context().rank.extent)


def enter_context(value: Context) -> contextvars.Token[Context]:
    return _current.set(value)


def exit_context(token: contextvars.Token[Context]) -> None:
    _current.reset(token)
