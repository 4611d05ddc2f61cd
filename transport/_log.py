"""Structured logging for every meshvisor process, quiet unless asked.

The level and format come from this process's `TransportSettings` (``MESHVISOR_LOG_LEVEL``:
debug, info, warning, error; default warning; ``MESHVISOR_LOG_FORMAT``: console or json), read
when the first logger is made. meshvisor never touches
the application's own structlog or logging configuration.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

from ._settings import transport_settings

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def _make_logger() -> Any:
    settings = transport_settings()
    level = _LEVELS[settings.log_level]
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


_root: Any = None


def get_logger(component: str, **bound: Any) -> Any:
    """Return a structlog logger bound to `component` (and the current pid)."""
    global _root
    if _root is None:
        _root = _make_logger()
    return _root.bind(component=component, pid=os.getpid(), **bound)


def reset_logging() -> None:
    """Forget the cached logger (for forked children, and after the log settings changed)."""
    global _root
    _root = None
