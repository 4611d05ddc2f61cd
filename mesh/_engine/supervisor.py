"""`Supervisor`: sends each failure of something this process owns to whoever must decide.

Order of decision: a handler registered on the failed mesh (``mesh.on_failure``); else the
owning actor's ``__supervise__``; at the client, the global unhandled-failure hook; else
fail-fast (a `SupervisionError` in the client's main thread).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from mesh._engine.failfast import FAIL_FAST
from supervision import SupervisionEvent, event_listeners, is_handled, unhandled_failure_hook
from transport import get_logger

if TYPE_CHECKING:
    from mesh._engine.runtime import Runtime

FailureHandler = Callable[[SupervisionEvent], object]


class Supervisor:
    """Routes the supervision events that reach one process."""

    def __init__(self, runtime: Runtime, *, is_root: bool) -> None:
        self._runtime = runtime
        self._is_root = is_root
        self.handlers: dict[str, FailureHandler] = {}
        self.actor_mesh_owners: dict[str, str | None] = {}
        self.actor_meshes_on: dict[str, list[str]] = {}  # proc id -> actor meshes spawned there
        self._seen: set[tuple[str | None, str | None, str]] = set()
        self._observed: set[tuple[str | None, str | None, str]] = set()
        self._log = get_logger("supervision", proc=runtime.proc_id)

    @property
    def is_root(self) -> bool:
        """Whether this is the client's supervisor, the root of the tree."""
        return self._is_root

    def handlers_for_proc(self, proc_id: str, mesh_key: str) -> tuple[str, ...]:
        """Handler keys for a proc's death: the actor meshes on it, then its proc mesh."""
        return (*self.actor_meshes_on.get(proc_id, ()), mesh_key)

    def handle(
        self,
        event: SupervisionEvent,
        owner_actor: str | None,
        keys: tuple[str, ...],
        told: Mapping[str, SupervisionEvent] | None = None,
    ) -> None:
        """Decide what `event` (a failure of something owned here) leads to. Loop thread.
        The handler of a key hears `told[key]` where given (its mesh's view), else `event`."""
        identity = (event.actor_id, event.proc_id, event.kind)
        self.observe(event)
        if identity in self._seen:
            return
        self._seen.add(identity)
        for key in keys:
            handler = self.handlers.get(key)
            heard = event if told is None else told.get(key, event)
            if handler is not None and self._run_handler(handler, heard):
                return
        if owner_actor is not None and self._runtime.host.supervise(owner_actor, event):
            return
        if self._is_root:
            hook = unhandled_failure_hook()
            if hook is not None and self._run_handler(hook, event):
                return
            FAIL_FAST.raise_in_main(event)
        else:
            self._log.error(
                "unowned_failure", reason="no actor of this proc owns the mesh", **event.to_dict()
            )

    def observe(self, event: SupervisionEvent) -> None:
        """Log `event` and tell the event listeners, once per failure, whoever decides."""
        identity = (event.actor_id, event.proc_id, event.kind)
        if identity in self._observed:
            return
        self._observed.add(identity)
        self._log.warning("supervision_event", **event.to_dict())
        for listener in event_listeners():
            try:
                listener(event)
            except Exception:
                self._log.error(
                    "event_listener_raised", listener=repr(listener), error=traceback.format_exc()
                )

    def forget_mesh(self, key: str, actor_ids: list[str], proc_ids: list[str]) -> None:
        """A stopped proc mesh (and the actor meshes on it) will never fail again."""
        for name in (key, *actor_ids):
            self.handlers.pop(name, None)
            self.actor_mesh_owners.pop(name, None)
        for proc_id in proc_ids:
            self.actor_meshes_on.pop(proc_id, None)

    def forget(self, actor_id: str) -> None:
        """Failures of `actor_id` seen so far are history: it is being rebuilt."""
        self._seen = {seen for seen in self._seen if seen[0] != actor_id}
        self._observed = {seen for seen in self._observed if seen[0] != actor_id}

    def _run_handler(self, handler: FailureHandler, event: SupervisionEvent) -> bool:
        try:
            return is_handled(handler(event))
        except Exception:
            self._log.error(
                "failure_handler_raised",
                handler=repr(handler),
                error=traceback.format_exc(),
                **event.to_dict(),
            )
            return False
