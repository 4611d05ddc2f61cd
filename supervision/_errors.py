"""Errors that reach user code.

Exception tree::

    Exception
    ├── RuntimeError
    │   └── SupervisionError      something failed (crashed, hung, stopped); `.event` says what
    └── ActorError                an endpoint raised; the actor survives. Also an instance of the
                                  original exception's type where that type can be subclassed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._events import SupervisionEvent


class SupervisionError(RuntimeError):
    """A supervised mesh failed or was stopped; `event` holds the `SupervisionEvent`."""

    def __init__(self, event: SupervisionEvent, context: str = "") -> None:
        self.event = event
        self.context = context
        #: Other failures raised together with this one (e.g. every rank of a lost host).
        self.related_events: tuple[SupervisionEvent, ...] = ()
        super().__init__(f"{context}{event}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.event, self.context)

    def report(self) -> str:
        return self.event.report()


class ActorError(Exception):
    """An endpoint raised `exception` on one actor; the actor itself is still alive.

    `str()` is one line; the remote traceback is a note (PEP 678), so that Python prints it
    under the exception wherever it goes uncaught or is logged with its traceback.
    """

    exception: BaseException | None
    exception_type: str
    remote_traceback: str
    mesh_name: str
    rank: Mapping[str, int] | None
    actor_id: str | None
    endpoint: str | None
    host: str | None
    pid: int | None

    def __init__(
        self,
        message: str,
        *,
        exception: BaseException | None = None,
        exception_type: str = "Exception",
        remote_traceback: str = "",
        mesh_name: str = "",
        rank: Mapping[str, int] | None = None,
        actor_id: str | None = None,
        endpoint: str | None = None,
        host: str | None = None,
        pid: int | None = None,
    ) -> None:
        BaseException.__init__(self, message)
        self.exception = exception
        self.exception_type = exception_type
        self.remote_traceback = remote_traceback
        self.mesh_name = mesh_name
        self.rank = rank
        self.actor_id = actor_id
        self.endpoint = endpoint
        self.host = host
        self.pid = pid
        if remote_traceback:  # it holds the original's notes: those copied by wrap() go
            self.__notes__ = [_remote_note(remote_traceback, host, pid)]

    @classmethod
    def wrap(
        cls, message: str, *, exception_class: type | None = None, **fields: Any
    ) -> ActorError:
        """An ActorError that is also an instance of the original exception's type (that of
        `exception`, or `exception_class` when the instance could not be rebuilt)."""
        original = fields.get("exception")
        kind = type(original) if original is not None else exception_class
        target = _combined_type(kind) if isinstance(kind, type) else cls
        error = target.__new__(target, message)
        if original is not None and target is not cls:  # e.g. .event of a SupervisionError
            error.__dict__.update(getattr(original, "__dict__", {}))
        ActorError.__init__(error, message, **fields)
        return error

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        fields = {k: getattr(self, k) for k in ActorError.__annotations__}
        return _rebuild_actor_error, (str(self), fields)


def _remote_note(remote_traceback: str, host: str | None, pid: int | None) -> str:
    """The remote traceback as a note: a heading naming the process, then the text indented."""
    where = f" (process {pid} on host {host})" if pid is not None else ""
    lines = remote_traceback.rstrip().splitlines()
    return "\n".join([f"Remote traceback{where}:", *(f"  {line}" for line in lines)])


def _rebuild_actor_error(message: str, fields: dict[str, Any]) -> ActorError:
    return ActorError.wrap(message, **fields)


_combined: dict[type, type[ActorError]] = {}


def _combined_type(original: type[BaseException]) -> type[ActorError]:
    """ActorError mixed with `original`, cached; plain ActorError when they cannot mix."""
    if issubclass(original, ActorError):  # relayed through another actor: keep the deepest type
        wrapped = getattr(original, "_wrapped_type", None)
        return _combined_type(wrapped) if wrapped is not None else ActorError
    if not issubclass(original, Exception):
        return ActorError
    cached = _combined.get(original)
    if cached is None:
        try:
            cached = type(
                f"ActorError[{original.__name__}]",
                (ActorError, original),
                {
                    "__module__": "supervision",
                    "__init__": ActorError.__init__,
                    "__str__": ActorError.__str__,
                    "__reduce__": ActorError.__reduce__,
                    "_wrapped_type": original,
                },
            )
            cached.__new__(cached, "probe")  # some C types refuse to be built this way
        except TypeError:
            cached = ActorError
        _combined[original] = cached
    return cached
