"""`configure`: change this process's settings in code; `overridden_settings` for one block.

Keywords are the fields of `mesh.Settings` and of `transport.TransportSettings`. An override
takes effect in this process at once: a running session's runtime gets the new `Settings`
(timeouts are read when used), new messages and inboxes use the new size limit, and loggers
made afterwards the new log settings. Other processes read their own environment: a local agent
started afterwards (and the procs it forks) gets the overrides through it; agents already
running, attached daemons included, keep theirs. Heartbeat settings apply to procs spawned
afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import fields, replace

from mesh._engine.session import session_if_started
from mesh._settings import Settings, current_settings, replace_current
from transport import TransportSettings, reset_logging, transport_settings, use_transport_settings

_SETTINGS_FIELDS = frozenset(f.name for f in fields(Settings))
_TRANSPORT_FIELDS = frozenset(f.name for f in fields(TransportSettings))


def configure(**changes: object) -> Settings:
    """Change this process's settings (keywords: fields of `mesh.Settings` and of
    `transport.TransportSettings`); returns the new `mesh.Settings`. Nothing changes if a value
    is invalid: the error names the keyword."""
    unknown = sorted(set(changes) - _SETTINGS_FIELDS - _TRANSPORT_FIELDS)
    if unknown:
        known = ", ".join(sorted(_SETTINGS_FIELDS | _TRANSPORT_FIELDS))
        raise TypeError(f"unknown setting(s) {', '.join(unknown)}: the settings are {known}")
    ours = {name: value for name, value in changes.items() if name in _SETTINGS_FIELDS}
    theirs = {name: value for name, value in changes.items() if name in _TRANSPORT_FIELDS}
    settings = replace(current_settings(), **ours)  # type: ignore[arg-type]
    transport = replace(transport_settings(), **theirs)  # type: ignore[arg-type]
    _install(settings, transport)
    return settings


@contextlib.contextmanager
def overridden_settings(**changes: object) -> Iterator[Settings]:
    """`configure(**changes)` for the block, then the settings from before it (for tests)."""
    before = current_settings(), transport_settings()
    try:
        yield configure(**changes)
    finally:
        _install(*before)


def _install(settings: Settings, transport: TransportSettings) -> None:
    """Make `settings` and `transport` this process's, and its running runtime's."""
    log_changed = (transport.log_level, transport.log_format) != (
        transport_settings().log_level,
        transport_settings().log_format,
    )
    replace_current(settings)
    use_transport_settings(transport)
    if log_changed:
        reset_logging()
    session = session_if_started()
    if session is not None:
        session.runtime.settings = settings
