"""`Supervisor`: sends each failure of something this process owns to whoever must decide.

Order of decision: a handler registered on the failed mesh (``mesh.on_failure``); else the
owning actor's ``__supervise__``; at the client, the global unhandled-failure hook; else
fail-fast (a `SupervisionError` in the client's main thread). A notice (``"preempting"``: the
procs' host goes away soon) asks the same handlers; unhandled, it is only logged (printed at
the root), since nothing has failed yet.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Mapping

from mesh._engine.failfast import FAIL_FAST
from mesh._engine.messages import PreemptionNotice, invalid_fields
from mesh._engine.ownership import FailureHandler, Ownership
from supervision import SupervisionEvent, event_listeners, is_handled, unhandled_failure_hook
from transport import Envelope, get_logger

#: Asks the owning actor's ``__supervise__`` (actor id, event); True when it handled it.
SuperviseOwner = Callable[[str, SupervisionEvent], bool]


class Supervisor:
    """Routes the supervision events that reach one process."""

    def __init__(
        self,
        ownership: Ownership,
        supervise_owner: SuperviseOwner,
        *,
        proc_id: str,
        is_root: bool,
    ) -> None:
        self._ownership = ownership
        self._supervise_owner = supervise_owner
        self._is_root = is_root
        self._seen: set[tuple[str | None, str | None, str]] = set()
        self._observed: set[tuple[str | None, str | None, str]] = set()
        self._log = get_logger("supervision", proc=proc_id)

    @property
    def is_root(self) -> bool:
        """Whether this is the client's supervisor, the root of the tree."""
        return self._is_root

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
        if not event.is_notice:  # every notice is news
            self._seen.add(identity)
        for key in keys:
            handler = self._ownership.handler(key)
            heard = event if told is None else told.get(key, event)
            if handler is not None and self._run_handler(handler, heard):
                return
        if owner_actor is not None and self._supervise_owner(owner_actor, event):
            return
        if self._is_root:
            hook = unhandled_failure_hook()
            if hook is not None and self._run_handler(hook, event):
                return
            if event.is_notice:
                print(f"meshvisor: {event} Nothing handles it: going on.", file=sys.stderr)
                self._log.warning("notice_not_handled", **event.to_dict())
                return
            FAIL_FAST.raise_in_main(event)
        elif event.is_notice:
            self._log.warning("notice_not_handled", **event.to_dict())
        else:
            self._log.error(
                "unowned_failure", reason="no actor of this proc owns the mesh", **event.to_dict()
            )

    def observe(self, event: SupervisionEvent) -> None:
        """Log `event` and tell the event listeners, once per failure, whoever decides."""
        identity = (event.actor_id, event.proc_id, event.kind)
        if identity in self._observed:
            return
        if not event.is_notice:
            self._observed.add(identity)
        self._log.warning("supervision_event", **event.to_dict())
        for listener in event_listeners():
            try:
                listener(event)
            except Exception:
                self._log.error(
                    "event_listener_raised", listener=repr(listener), error=traceback.format_exc()
                )

    def on_notice(self, envelope: Envelope) -> None:
        """A host agent warns that the host of procs owned here goes away soon: the handlers
        of each proc hear a "preempting" event (an actor mesh's handler: of its actor)."""
        notice: PreemptionNotice = envelope.header
        reason = invalid_fields(notice)
        if reason is not None:
            self._log.warning("message_rejected", kind="PreemptionNotice", reason=reason)
            return
        why = f"its host agent got {notice.signal}"
        for proc_id in notice.proc_ids:
            peer = self._ownership.peer(proc_id)
            if peer is None or not peer.owned or not peer.alive:
                continue
            event = peer.make_event("preempting", why, time_left_s=notice.time_left_s)
            told = {
                actors.actor_id: actors.view().proc_failed(peer, event)
                for actors in self._ownership.actor_meshes_on(peer)
            }
            subject = next(iter(told.values()), event)
            told[peer.mesh_key] = event
            self.handle(subject, peer.owner_actor, tuple(told), told)

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
