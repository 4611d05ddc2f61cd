"""Supervision: failures as events that travel up the tree, and the errors users catch."""

from ._errors import ActorError as ActorError
from ._errors import SupervisionError as SupervisionError
from ._events import EVENT_KINDS as EVENT_KINDS
from ._events import EventKind as EventKind
from ._events import SupervisionEvent as SupervisionEvent

__all__ = ("EVENT_KINDS", "ActorError", "EventKind", "SupervisionError", "SupervisionEvent")

ActorError.__module__ = __name__
SupervisionError.__module__ = __name__
SupervisionEvent.__module__ = __name__
