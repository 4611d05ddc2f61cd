"""`TransportSettings`: the transport's own settings, one frozen object built from the environment.

`transport` is the lowest layer and cannot import `mesh`, so its settings (largest message, log
level and format, CURVE keys directory) are a frozen object of their own; `mesh.Settings` sits
beside it and `mesh.configure` changes both. The process keeps one current value, read from the
environment on first use; `use_transport_settings` replaces it. Child processes (agents, procs)
get theirs through their environment (`to_env`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

#: Environment variable of each field, and how the README documents it.
ENV_NAMES = {
    "max_message_bytes": "MESHVISOR_MAX_MESSAGE_BYTES",
    "log_level": "MESHVISOR_LOG_LEVEL",
    "log_format": "MESHVISOR_LOG_FORMAT",
    "curve_keys": "MESHVISOR_CURVE_KEYS",
}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("console", "json")


@dataclass(frozen=True)
class TransportSettings:
    """How this process frames, logs and authenticates its messages (validated when built)."""

    #: The largest message sent or accepted; larger ones are refused with a clear error.
    max_message_bytes: int = 1 << 30
    #: One of `LOG_LEVELS`: records below it are dropped.
    log_level: str = "warning"
    #: "console" (plain lines) or "json" (one JSON object per line).
    log_format: str = "console"
    #: The directory of the allocation's CURVE key pair; None where tcp security is not set up.
    curve_keys: str | None = None

    def __post_init__(self) -> None:
        size = self.max_message_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"max_message_bytes must be a number of bytes > 0, not {size!r}")
        _check_choice("log_level", self.log_level, LOG_LEVELS)
        _check_choice("log_format", self.log_format, LOG_FORMATS)
        if self.curve_keys is not None and not isinstance(self.curve_keys, str):
            raise TypeError(f"curve_keys must be a directory path (str), not {self.curve_keys!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TransportSettings:
        """The settings named by MESHVISOR_* variables in `environ`; defaults for unset ones;
        a ValueError naming the variable for a bad value."""
        values: dict[str, object] = {}
        for name, variable in ENV_NAMES.items():
            raw = environ.get(variable)
            if raw:
                values[name] = _parse(name, variable, raw)
        return cls(**values)  # type: ignore[arg-type]

    def to_env(self) -> dict[str, str]:
        """These settings as the environment variables a child process reads them from."""
        env = {ENV_NAMES[f.name]: str(getattr(self, f.name)) for f in fields(self)}
        if self.curve_keys is None:
            del env[ENV_NAMES["curve_keys"]]
        return env


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, not {value!r}")


def _parse(name: str, variable: str, raw: str) -> object:
    """The value of field `name` written as `raw` in environment variable `variable`."""
    if name == "max_message_bytes":
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value <= 0:
            raise ValueError(
                f"environment variable {variable}={raw!r} must be a whole number of bytes > 0 "
                f"(e.g. {TransportSettings.max_message_bytes}); fix or unset it"
            )
        return value
    if name in ("log_level", "log_format"):
        choices = LOG_LEVELS if name == "log_level" else LOG_FORMATS
        if raw.lower() not in choices:
            raise ValueError(
                f"environment variable {variable}={raw!r} must be one of {', '.join(choices)}; "
                "fix or unset it"
            )
        return raw.lower()
    return raw


#: The settings in force (`transport_settings` reads them, `use_transport_settings` sets them).
current: TransportSettings | None = None


def transport_settings() -> TransportSettings:
    """This process's transport settings: the last ones set, else those of the environment."""
    global current
    if current is None:
        current = TransportSettings.from_env()
    return current


def use_transport_settings(settings: TransportSettings | None) -> None:
    """Make `settings` this process's transport settings (None: read the environment again)."""
    global current
    current = settings


def use_curve_keys(directory: str) -> None:
    """Authenticate with the CURVE keys in `directory` from now on, in this process and in the
    processes it starts (they inherit MESHVISOR_CURVE_KEYS)."""
    os.environ[ENV_NAMES["curve_keys"]] = directory
    use_transport_settings(replace(transport_settings(), curve_keys=directory))
