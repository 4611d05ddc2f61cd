"""`get_or_spawn_controller`: one named singleton actor per client, handed to every caller.

Each controller runs alone in its own proc on the client's local host (`this_host()`), owned
by the client like any mesh it spawns: when that proc dies or the actor fails, calls on the
handle raise `SupervisionError` and the failure goes to the client's handlers as for any actor
(fail-fast unless handled). The registry learns of the failure from the same event, and the
next `get_or_spawn_controller` of that name spawns a new controller (Monarch's keeps
answering with the failure instead). Concurrent callers share one spawn: a lock covers the
look-up and the spawn, which returns at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, TypeVar

from mesh._actor import check_actor_class
from mesh._api.actor_mesh import ActorMesh
from mesh._api.host_mesh import this_host
from mesh._api.mesh_base import check_name
from mesh._api.proc_mesh import ProcMesh
from mesh._context import actor_identity
from mesh._engine.future import Future, resolved
from mesh._engine.runtime import Runtime
from mesh._engine.session import current_session
from supervision import SupervisionEvent, add_event_listener

A = TypeVar("A")


@dataclass
class _Controller:
    """One controller: its class, its proc and actor, and whether a failure ended it."""

    actor_class: type
    procs: ProcMesh
    actors: ActorMesh[Any]
    proc_id: str
    actor_id: str
    failed: bool = False

    @property
    def usable(self) -> bool:
        peer = self.procs._peers[0]
        return not (self.failed or peer.finished or self.actors._state.stopped)


class _Registry:
    """The controllers of this client's session, by name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runtime: Runtime | None = None
        self._controllers: dict[str, _Controller] = {}
        add_event_listener(self._on_event)

    def get_or_spawn(self, name: str, actor_class: type[A], args: Any, kwargs: Any) -> Any:
        session = current_session()
        if not session.is_client:
            raise RuntimeError(
                f"get_or_spawn_controller({name!r}) works in the client only: meshvisor keeps "
                "one registry of controllers per client. Get the controller in the client and "
                "pass its handle to your actors (actor mesh handles pickle)."
            )
        check_name("controller", name)
        check_actor_class(actor_class)
        with self._lock:
            if self._runtime is not session.runtime:  # a new session: the old procs are gone
                self._runtime, self._controllers = session.runtime, {}
            found = self._controllers.get(name)
            if found is not None and found.usable:
                if found.actor_class is not actor_class:
                    raise TypeError(
                        f"controller {name!r} runs {found.actor_class.__qualname__}, not "
                        f"{actor_class.__qualname__}; give each controller its own name"
                    )
                return found.actors
            if found is not None:
                found.procs.stop()  # its actor failed or was stopped: nothing else is on it
            controller = self._spawn(name, actor_class, args, kwargs)
            self._controllers[name] = controller
            return controller.actors

    def stop_all(self) -> list[Future[None]]:
        """Stop every controller's proc; the next get_or_spawn spawns anew."""
        with self._lock:
            controllers, self._controllers = list(self._controllers.values()), {}
        return [controller.procs.stop() for controller in controllers]

    @staticmethod
    def _spawn(name: str, actor_class: type, args: Any, kwargs: Any) -> _Controller:
        procs = this_host().spawn_procs(per_host={}, name=name)
        try:
            actors: ActorMesh[Any] = procs.spawn(name, actor_class, *args, **kwargs)
        except BaseException:  # e.g. arguments that do not pickle: leave no proc behind
            procs.stop()
            raise
        actor_id = actor_identity(actors._state.actor_id, 0)
        return _Controller(actor_class, procs, actors, procs._peers[0].proc_id, actor_id)

    def _on_event(self, event: SupervisionEvent) -> None:
        """Mark the controller that `event` ends as failed (the owner decides as usual)."""
        if event.is_notice:
            return
        # No lock: this runs on the event loop thread, which a spawn under the lock may wait on.
        for controller in list(self._controllers.values()):
            if event.proc_id == controller.proc_id or event.actor_id == controller.actor_id:
                controller.failed = True


_registry: _Registry | None = None
_registry_lock = threading.Lock()


def _the_registry() -> _Registry:
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = _Registry()
        return _registry


def get_or_spawn_controller(
    name: str, actor_class: type[A], *args: Any, **kwargs: Any
) -> Future[ActorMesh[A]]:
    """The controller called `name`: an `ActorMesh` of one `actor_class(*args, **kwargs)`,
    spawned in its own proc on this host by the first caller and returned to every later one
    (arguments of later calls are not used). After it failed (its proc died, its actor
    failed), the next call spawns a new one. In the client only; a RuntimeError inside an
    actor (Monarch allows that), a TypeError when `name` is a controller of another class."""
    return resolved(_the_registry().get_or_spawn(name, actor_class, args, kwargs))


def stop_controllers() -> None:
    """Stop every controller of this client and wait for their procs to end (for tests)."""
    for stopped in _the_registry().stop_all():
        stopped.get()
