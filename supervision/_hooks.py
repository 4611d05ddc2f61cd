"""The client's global hook for failures that no handler took, and event listeners."""

from __future__ import annotations

from collections.abc import Callable

from ._events import SupervisionEvent

UnhandledFailureHook = Callable[[SupervisionEvent], object]
EventListener = Callable[[SupervisionEvent], None]

_hook: UnhandledFailureHook | None = None
_listeners: list[EventListener] = []


def set_unhandled_failure_hook(hook: UnhandledFailureHook | None) -> UnhandledFailureHook | None:
    """Install `hook` for failures that reach the client unhandled; returns the previous one.

    The hook runs on meshvisor's event loop thread. Returning a truthy value handles the
    failure; a falsy value (or no hook) keeps the fail-fast default: a `SupervisionError` is
    raised in the client's main thread.
    """
    global _hook
    previous, _hook = _hook, hook
    return previous


def unhandled_failure_hook() -> UnhandledFailureHook | None:
    """The hook installed by `set_unhandled_failure_hook`, if any."""
    return _hook


def add_event_listener(listener: EventListener) -> Callable[[], None]:
    """Call `listener(event)` for every supervision event that reaches this process, handled
    or not (restarted by a policy included), before anything decides about it.

    For metrics, dashboards and the chaos harness: a listener observes, it cannot handle. It
    runs on meshvisor's event loop thread and must be quick; what it raises is logged and
    ignored. Returns a function that removes the listener.
    """
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def event_listeners() -> tuple[EventListener, ...]:
    """The listeners added by `add_event_listener`."""
    return tuple(_listeners)
