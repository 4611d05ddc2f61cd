"""Supervision: failures as events that travel up the tree, and the errors users catch."""

from ._errors import ActorError as ActorError
from ._errors import SupervisionError as SupervisionError
from ._escalation import escalated as escalated
from ._escalation import is_handled as is_handled
from ._events import EVENT_KINDS as EVENT_KINDS
from ._events import NOTICE_KINDS as NOTICE_KINDS
from ._events import EventKind as EventKind
from ._events import SupervisionEvent as SupervisionEvent
from ._evidence import split_stack_dump as split_stack_dump
from ._hooks import EventListener as EventListener
from ._hooks import UnhandledFailureHook as UnhandledFailureHook
from ._hooks import add_event_listener as add_event_listener
from ._hooks import event_listeners as event_listeners
from ._hooks import set_unhandled_failure_hook as set_unhandled_failure_hook
from ._hooks import unhandled_failure_hook as unhandled_failure_hook
from ._restart import RestartDecision as RestartDecision
from ._restart import RestartPolicy as RestartPolicy
from ._restart import RestartTracker as RestartTracker

__all__ = (
    "EVENT_KINDS",
    "NOTICE_KINDS",
    "ActorError",
    "EventKind",
    "EventListener",
    "RestartDecision",
    "RestartPolicy",
    "RestartTracker",
    "SupervisionError",
    "SupervisionEvent",
    "UnhandledFailureHook",
    "add_event_listener",
    "escalated",
    "event_listeners",
    "is_handled",
    "set_unhandled_failure_hook",
    "split_stack_dump",
    "unhandled_failure_hook",
)

ActorError.__module__ = __name__
RestartDecision.__module__ = __name__
RestartPolicy.__module__ = __name__
RestartTracker.__module__ = __name__
SupervisionError.__module__ = __name__
SupervisionEvent.__module__ = __name__
add_event_listener.__module__ = __name__
escalated.__module__ = __name__
event_listeners.__module__ = __name__
is_handled.__module__ = __name__
set_unhandled_failure_hook.__module__ = __name__
unhandled_failure_hook.__module__ = __name__
