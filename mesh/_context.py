"""Who is running: the actor, rank and mesh of the message being handled right now."""

from __future__ import annotations

import contextvars
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from mesh._settings import current_settings
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


#: What `exit_context` needs to restore the context (and structlog's) of before.
ContextToken = tuple[contextvars.Token[Context], Mapping[str, contextvars.Token[Any]]]


def enter_context(value: Context) -> ContextToken:
    """Run as `value`: `context()` returns it, and structlog's context variables hold its
    identity (``actor_id``, ``mesh_name``, ``rank``), so that structlog loggers configured
    with ``merge_contextvars`` (structlog's default) log it. Only once the process has
    imported structlog (the actor's code did; a module half imported by another thread is
    not used): importing it costs every proc ~0.1 s."""
    token = _current.set(value)
    structlog = sys.modules.get("structlog")
    if structlog is None or getattr(structlog.__spec__, "_initializing", False):
        return token, {}  # not imported, or another thread is importing it right now
    bound = structlog.contextvars.bind_contextvars(
        actor_id=value.actor_id, mesh_name=value.mesh_name, rank=dict(value.rank)
    )
    return token, bound


def exit_context(token: ContextToken) -> None:
    if token[1]:
        sys.modules["structlog"].contextvars.reset_contextvars(**token[1])
    _current.reset(token[0])


def install_record_identity() -> None:
    """Give every `logging` record made in this process the running actor's identity, as
    the attributes ``actor_id``, ``mesh_name`` (None outside actors) and ``rank`` (a dict, {}
    outside actors), for formats such as ``"%(mesh_name)s %(rank)s %(message)s"``."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "meshvisor_identity", False):
        return

    def make_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        running = _current.get(None)
        record.actor_id = running.actor_id if running is not None else None
        record.mesh_name = running.mesh_name if running is not None else None
        record.rank = dict(running.rank) if running is not None else {}
        return record

    make_record.meshvisor_identity = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(make_record)
