"""Escalation: what an owner's decision about a child's failure turns into."""

from __future__ import annotations

import traceback
from dataclasses import replace

from ._events import SupervisionEvent


def escalated(
    child: SupervisionEvent, owner: SupervisionEvent, handler_error: BaseException | None = None
) -> SupervisionEvent:
    """The owner's own failure event, caused by `child` (and by `handler_error` if the
    owner's ``__supervise__`` raised)."""
    message = f"it did not handle the failure of mesh {child.mesh_name!r}"
    text = owner.traceback
    if handler_error is not None:
        message = (
            f"its __supervise__ raised {type(handler_error).__name__}: {handler_error} "
            f"while handling the failure of mesh {child.mesh_name!r}"
        )
        text = "".join(traceback.format_exception(handler_error))
    return replace(owner, kind="escalated", message=message, traceback=text, cause=child)


def is_handled(decision: object) -> bool:
    """A handler's return value: truthy handles the failure, anything else escalates it."""
    return bool(decision)
