"""`configure`: change this process's settings in code; `configured` for one block.

Keywords are the fields of `mesh.Settings` and of `transport.TransportSettings` (Monarch's
key names are accepted where one means the same thing, see `monarch_keys`). An override
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

from mesh._api.monarch_keys import TRANSLATED, translate
from mesh._engine.session import session_if_started
from mesh._settings import Settings, current_settings, replace_current
from transport import TransportSettings, reset_logging, transport_settings, use_transport_settings

_SETTINGS_FIELDS = frozenset(f.name for f in fields(Settings))
_TRANSPORT_FIELDS = frozenset(f.name for f in fields(TransportSettings))


def configure(**changes: object) -> Settings:
    """Change this process's settings (keywords: fields of `mesh.Settings` and of
    `transport.TransportSettings`, or Monarch's names for them, e.g. ``mesh_orphan_timeout=
    "30s"``); returns the new `mesh.Settings`. A bad key or value changes nothing: the error
    names it. Unlike Monarch's, which returns None, it returns the settings now in force."""
    ours = translate(changes)
    unknown = sorted(set(ours) - _SETTINGS_FIELDS - _TRANSPORT_FIELDS)
    if unknown:
        known = ", ".join(sorted(_SETTINGS_FIELDS | _TRANSPORT_FIELDS))
        raise TypeError(f"unknown setting(s) {', '.join(unknown)}: the settings are {known}")
    mesh_changes = {name: value for name, value in ours.items() if name in _SETTINGS_FIELDS}
    transport_changes = {name: value for name, value in ours.items() if name in _TRANSPORT_FIELDS}
    try:
        settings = replace(current_settings(), **mesh_changes)  # type: ignore[arg-type]
        transport = replace(transport_settings(), **transport_changes)  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        aliases = [f"{key} is {TRANSLATED[key][0]}" for key in changes if key in TRANSLATED]
        if not aliases:
            raise
        raise type(error)(f"{error} (Monarch's {', '.join(aliases)})") from None
    _install(settings, transport)
    return settings


@contextlib.contextmanager
def configured(**changes: object) -> Iterator[Settings]:
    """``with configured(**changes) as settings:`` `configure(**changes)` for the block, then
    the settings from before it again (also when the block raises). It changes this whole
    process, every thread included, as Monarch's does; it yields the new `mesh.Settings`
    (Monarch's yields a dict of its configuration)."""
    before = current_settings(), transport_settings()
    settings = configure(**changes)
    try:
        yield settings
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
