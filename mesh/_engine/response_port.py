"""`ResponsePort`: how an ``@endpoint(explicit_response_port=True)`` answers its call.

The endpoint gets the port as its first argument and answers through it, now or later (from
another endpoint of the same actor, say), once: a value (``send``) or an exception. Its return
value is ignored. Every call still ends: a port dropped unanswered (the actor forgot it, or
failed, or stopped) answers with an error, and an exception that escapes the endpoint answers
the call when the port has not, else fails the actor (no one is left to tell).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

from mesh._engine.hosted_actor import HostedActor
from mesh._engine.messages import CallActor
from mesh._engine.replying import Replier
from transport import get_logger

#: What a call with an explicit response port returns: the caller is answered by the port.
NO_REPLY = object()


class RaisedAfterAnswering(BaseException):
    """An endpoint raised after its response port had answered: it fails the actor, as a
    broadcast that raises does, since the caller has its answer already."""


class ResponsePort:
    """The port of one call: ``send(value)`` or ``exception(error)``, once."""

    __slots__ = ("_actor", "_answered", "_header", "_lock", "_replier")

    def __init__(self, replier: Replier, actor: HostedActor, header: CallActor) -> None:
        self._replier = replier
        self._actor = actor
        self._header = header
        self._lock = threading.Lock()
        self._answered = False

    @property
    def answered(self) -> bool:
        return self._answered

    def send(self, value: Any) -> None:
        """Answer the call with `value`."""
        self._claim("send")
        self._replier.value(self._actor, self._header, value)

    def exception(self, error: BaseException) -> None:
        """Answer the call with `error` (the caller's ``get()`` raises it, as an ActorError)."""
        if not isinstance(error, BaseException):
            raise TypeError(f"exception() needs an exception, got {error!r}")
        self._claim("exception")
        self._answer_with(error)

    def _claim(self, what: str) -> None:
        with self._lock:
            if self._answered:
                raise ValueError(
                    f"the response port of {self._where()} was answered already; it answers "
                    f"its call once (not {what}() again). To send several values, pass a "
                    "Port from Channel.open() instead."
                )
            self._answered = True

    def _answer_with(self, error: BaseException) -> None:
        if self._header.reply_to is None:  # a broadcast: nobody waits for the answer
            get_logger("mesh.actor").error(
                "response_port_error_unheard", endpoint=self._where(), error=repr(error)
            )
            return
        self._replier.exception(self._actor, self._header, error)

    def _where(self) -> str:
        return f"endpoint {self._header.endpoint!r} of {self._actor.mesh_name!r}"

    def __del__(self) -> None:
        with self._lock:
            if self._answered:
                return
            self._answered = True
        actor = self._actor
        if actor.state == "failed" and actor.event is not None:
            self._replier.failure(self._header, "failed", actor.event, actor)
            return
        self._answer_with(
            RuntimeError(
                f"{self._where()} dropped its response port without answering (the port was "
                "garbage collected); call port.send(value) or port.exception(error)."
            )
        )

    def __reduce__(self) -> Any:
        raise TypeError(
            "a response port answers from the actor that got it; to answer from elsewhere, "
            "pass a Port from Channel.open() to the call instead."
        )

    def __repr__(self) -> str:
        state = "answered" if self._answered else "waiting"
        return f"<response port of {self._where()} {state}>"


def with_response_port(
    replier: Replier,
    actor: HostedActor,
    header: CallActor,
    method: Any,
    arguments: tuple[tuple[Any, ...], dict[str, Any]],
) -> Callable[[], Any]:
    """A function that runs ``method(port, *args, **kwargs)`` and returns `NO_REPLY` (a
    coroutine function when `method` is one)."""
    port = ResponsePort(replier, actor, header)
    args, kwargs = arguments

    def escaped(exc: Exception) -> None:
        if port.answered:
            raise RaisedAfterAnswering(f"{type(exc).__name__}: {exc}") from exc
        port.exception(exc)

    if inspect.iscoroutinefunction(method):

        async def run_async() -> object:
            try:
                await method(port, *args, **kwargs)
            except Exception as exc:
                escaped(exc)
            return NO_REPLY

        return run_async

    def run() -> object:
        try:
            method(port, *args, **kwargs)
        except Exception as exc:
            escaped(exc)
        return NO_REPLY

    return run
