"""Who is running: the actor, rank and mesh of the message being handled right now."""

from __future__ import annotations

import contextvars
import os
import socket
from dataclasses import dataclass
from typing import NoReturn

from mesh._shape import Extent, Point


class ActorAborted(BaseException):
    """Raised by `ActorInstance.abort`: the actor fails with `reason`. A BaseException, so
    that ``except Exception`` in the endpoint does not swallow it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ActorInstance:
    """The running actor itself, as Monarch's ``context().actor_instance``."""

    __slots__ = ("_context",)

    def __init__(self, context: Context) -> None:
        self._context = context

    @property
    def actor_id(self) -> str | None:
        return self._context.actor_id

    def abort(self, reason: str | None = None) -> NoReturn:
        """Fail this actor with `reason`: its owner gets a supervision event saying so, and
        the callers of this call and of those queued get a SupervisionError. Unlike Monarch's
        (which returns and kills the actor soon after), it raises `ActorAborted` at once, so
        nothing after it runs; in the client it is a RuntimeError."""
        if self._context.actor_id is None:
            raise RuntimeError(
                "abort() fails the actor it is called in, but this code runs in the client, "
                "outside any actor; raise an exception or stop the program instead."
            )
        raise ActorAborted(reason or "no reason given")


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

    @property
    def actor_instance(self) -> ActorInstance:
        """The running actor (``context().actor_instance.abort(reason)`` fails it)."""
        return ActorInstance(self)


_EMPTY_POINT = Point((), Extent((), ()))
_current: contextvars.ContextVar[Context] = contextvars.ContextVar("meshvisor_context")


def actor_identity(mesh_id: str, rank: int) -> str:
    """The id of the actor at flat `rank` of the actor mesh `mesh_id`: one per actor, kept
    when the actor is rebuilt after a failure (`Context.restart_count` tells them apart)."""
    return f"{mesh_id}[{rank}]"


def client_context() -> Context:
    return Context(None, None, _EMPTY_POINT, "client", socket.gethostname(), os.getpid())


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
