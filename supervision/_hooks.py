"""The client's global hook for failures that no handler took."""

from __future__ import annotations

from collections.abc import Callable

from ._events import SupervisionEvent

UnhandledFailureHook = Callable[[SupervisionEvent], object]

_hook: UnhandledFailureHook | None = None


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
