"""Structured logging for every meshvisor process, quiet unless asked.

The level and format come from this process's `TransportSettings` (``MESHVISOR_LOG_LEVEL``:
debug, info, warning, error; default warning; ``MESHVISOR_LOG_FORMAT``: console or json), read
when the first logger is made. meshvisor never touches
the application's own structlog or logging configuration.

structlog is imported at the first record at or above the level, not before: importing it costs
~0.1 s of CPU, paid by every host agent and proc at start-up otherwise, though most log nothing.
The client imports it beside its start (`warm_logging`), off the path of its first failure.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from ._settings import transport_settings

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


#: The level of each logging method of a structlog bound logger; the others (bind, new, ...)
#: are always passed on.
_METHOD_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
}


def _make_logger(level: int) -> Any:
    import structlog

    settings = transport_settings()
    renderer: Any
    if settings.log_format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=False, exception_formatter=structlog.dev.plain_traceback
        )
    return structlog.wrap_logger(
        _StderrLogger(),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        cache_logger_on_first_use=True,
    )


class _StderrLogger:
    """Writes each record as one line to the current stderr; never raises (a closed or broken
    stderr must not take supervision down with it)."""

    def msg(self, message: str) -> None:
        try:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):
            pass

    log = debug = info = warn = warning = msg
    err = error = critical = exception = fatal = failure = msg


class _Root:
    """This process's level, and its structlog logger once a record needs it."""

    def __init__(self) -> None:
        self.level = _LEVELS[transport_settings().log_level]
        self._logger: Any = None

    def logger(self) -> Any:
        if self._logger is None:
            self._logger = _make_logger(self.level)
        return self._logger


class _Logger:
    """A structlog bound logger, made when a record at or above the level comes (records
    below it cost a dict look-up); anything else than logging is passed on to it."""

    __slots__ = ("_bound", "_root")

    def __init__(self, root: _Root, bound: dict[str, Any]) -> None:
        self._root, self._bound = root, bound

    def bind(self, **more: Any) -> _Logger:
        return _Logger(self._root, {**self._bound, **more})

    def __getattr__(self, name: str) -> Any:
        if _METHOD_LEVELS.get(name, logging.CRITICAL) < self._root.level:
            return _ignore
        return getattr(self._root.logger().bind(**self._bound), name)


def _ignore(*_: Any, **__: Any) -> None:
    return None


_root: _Root | None = None


def get_logger(component: str, **bound: Any) -> Any:
    """Return a structlog logger bound to `component` (and the current pid)."""
    return _Logger(_current_root(), {"component": component, "pid": os.getpid(), **bound})


def warm_logging() -> None:
    """Make this process's structlog logger now, on a daemon thread, if its level lets
    warnings through: a client's first supervision event, logged as a warning, then does
    not pay structlog's import (0.1 to 0.25 s, with the modules structlog.dev pulls in)."""
    root = _current_root()
    if root.level <= logging.WARNING:
        threading.Thread(target=root.logger, name="meshvisor-log-warm-up", daemon=True).start()


def _current_root() -> _Root:
    global _root
    if _root is None:
        _root = _Root()
    return _root


def reset_logging() -> None:
    """Forget the cached logger (for forked children, and after the log settings changed)."""
    global _root
    _root = None
