"""The endpoints every actor has, as a table: name -> handler.

``__ping__`` answers the proc's pid once the actor runs (health probes), ``__initialized__``
None once its constructor has ended (`ActorMesh.initialized`); for fault injection,
``__fail_next__`` makes the next call of an endpoint raise and ``__exit_process__`` makes the
proc exit with a code. A handler turns the call's payload into the function the call runs, so
built-ins go through the same call path as user endpoints (the same checks, context and reply).
Only the handlers that take arguments unpickle the payload: a probe must not depend on it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

from mesh._engine.module_reload import reload_changed
from transport import Payload, get_logger


class InjectedFailures:
    """Failures asked for by ``__fail_next__``: per actor, the next call (of one endpoint, or
    of any when the endpoint is None) raises the given error instead of running."""

    def __init__(self) -> None:
        #: By actor id: (the endpoint, or None for any) and the error its next call raises.
        self.pending: dict[str, tuple[str | None, BaseException]] = {}
        self._log = get_logger("mesh.actor")

    def install(self, actor_id: str, endpoint: str | None, error: BaseException) -> None:
        self.pending[actor_id] = (endpoint, error)
        self._log.info("failure_injected", actor_id=actor_id, endpoint=endpoint)

    def take(self, actor_id: str, endpoint: str) -> BaseException | None:
        """The error a call of `endpoint` must raise instead of running, if one was injected."""
        found = self.pending.get(actor_id)
        if found is None or (found[0] is not None and found[0] != endpoint):
            return None
        del self.pending[actor_id]
        return found[1]


#: A built-in endpoint: from the call's payload ((args, kwargs), still pickled), the actor's id
#: and the proc's injected failures, the no-argument function the call runs.
Builtin = Callable[[Payload | None, str, InjectedFailures], Callable[[], object]]


def _ping(payload: Payload | None, actor_id: str, injected: InjectedFailures) -> Callable[[], int]:
    return os.getpid


def _fail_next(
    payload: Payload | None, actor_id: str, injected: InjectedFailures
) -> Callable[[], None]:
    endpoint, error = _positional(payload)
    injected.install(actor_id, endpoint, error)
    return _nothing


def _exit_process(
    payload: Payload | None, actor_id: str, injected: InjectedFailures
) -> Callable[[], object]:
    return functools.partial(os._exit, _positional(payload)[0])


def _positional(payload: Payload | None) -> tuple[Any, ...]:
    """The positional arguments of a built-in call."""
    if payload is None:
        raise ValueError("this built-in endpoint needs arguments, and its call came without")
    args: tuple[Any, ...] = payload.load()[0]
    return args


def _nothing() -> None:
    return None


def _initialized(
    payload: Payload | None, actor_id: str, injected: InjectedFailures
) -> Callable[[], None]:
    return _nothing


def _reload_workspace(
    payload: Payload | None, actor_id: str, injected: InjectedFailures
) -> Callable[[], list[str]]:
    return functools.partial(reload_changed, *_positional(payload))


#: The built-in that `ActorMesh.initialized` calls: answered once the constructor has ended.
INITIALIZED = "__initialized__"
#: The built-in that ``sync_workspace(reload="modules")`` calls: reloads changed modules.
RELOAD_WORKSPACE = "__reload_workspace__"

BUILTINS: Mapping[str, Builtin] = {
    "__ping__": _ping,
    INITIALIZED: _initialized,
    "__fail_next__": _fail_next,
    "__exit_process__": _exit_process,
    RELOAD_WORKSPACE: _reload_workspace,
}
