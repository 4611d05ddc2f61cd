"""`Settings`: meshvisor's tunables, one frozen object built from the MESHVISOR_* variables.

The type sits beside `transport.TransportSettings` (message size, logs, CURVE keys): transport
is the lowest layer and cannot import `mesh`, so it keeps its own frozen object; `configure`
changes both, keyword by keyword. Each process has one current `Settings`, read from the
environment on first use; its `Runtime` is built with it, and `configure` hands a new one to
the running runtime (the engine reads its timeouts when it uses them). Agents and procs are
separate processes: they read their own environment, which a local agent gets from the client
(`to_env` of the settings current when it starts) and procs from their agent. So an override
reaches this process at once, local agents started after it, and procs they fork; an agent
already running (an attached daemon, a local agent already started) keeps its own. Heartbeat
settings travel in each spawn request: they apply to procs spawned after the change.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from transport import reset_logging, use_transport_settings

#: Environment variable of each field (the README lists them).
ENV_NAMES = {
    "heartbeat_interval_s": "MESHVISOR_HEARTBEAT_INTERVAL_S",
    "heartbeat_timeout_s": "MESHVISOR_HEARTBEAT_TIMEOUT_S",
    "busy_timeout_s": "MESHVISOR_BUSY_TIMEOUT_S",
    "orphan_timeout_s": "MESHVISOR_ORPHAN_TIMEOUT_S",
    "agent_timeout_s": "MESHVISOR_AGENT_TIMEOUT_S",
    "owner_alive_interval_s": "MESHVISOR_OWNER_ALIVE_INTERVAL_S",
    "restart_wait_s": "MESHVISOR_RESTART_WAIT_S",
    "early_message_wait_s": "MESHVISOR_EARLY_MESSAGE_WAIT_S",
    "call_limit_s": "MESHVISOR_CALL_LIMIT_S",
    "preload": "MESHVISOR_PRELOAD",
    "home": "MESHVISOR_HOME",
    "host_name": "MESHVISOR_HOST_NAME",
    "fanout_min_recipients": "MESHVISOR_FANOUT_MIN_RECIPIENTS",
    "fanout_min_shared_recipients": "MESHVISOR_FANOUT_MIN_SHARED_RECIPIENTS",
}
#: The busy timeout when none is set: this long, or the heartbeat timeout where that is longer.
DEFAULT_BUSY_TIMEOUT_S = 60.0
_DURATIONS = tuple(name for name in ENV_NAMES if name.endswith("_s"))
#: Durations that may be 0 (orphans: SIGKILL at once); the others must be > 0.
_MAY_BE_ZERO = ("orphan_timeout_s",)
#: Durations that may be None (busy: derived from the heartbeat timeout; call limit: none).
_OPTIONAL = ("busy_timeout_s", "call_limit_s")
_COUNTS = ("fanout_min_recipients", "fanout_min_shared_recipients")
_HEARTBEATS = ("heartbeat_interval_s", "heartbeat_timeout_s", "busy_timeout_s")


@dataclass(frozen=True)
class Settings:
    """How this process supervises: heartbeat and failure-detection timeouts, restart waits,
    the call watchdog's default limit, the fork server's preloads, where allocations are kept
    and the name of this host. Validated when built."""

    #: How often new procs send a heartbeat to their agent.
    heartbeat_interval_s: float = 0.25
    #: Silence after which a stopped or idle proc is hung.
    heartbeat_timeout_s: float = 2.0
    #: Silence after which a proc is hung even though it uses CPU time; None: 60 s, or the
    #: heartbeat timeout where that is longer.
    busy_timeout_s: float | None = None
    #: Grace given to the procs of a client that died, before SIGKILL.
    orphan_timeout_s: float = 1.0
    #: Silence after which an attached (network) agent's procs are unreachable.
    agent_timeout_s: float = 2.0
    #: How often an owner attached to agents over the network tells them it is alive.
    owner_alive_interval_s: float = 0.5
    #: How long calls wait for a restarting rank before failing.
    restart_wait_s: float = 30.0
    #: How long a proc keeps a message for an actor it does not know, waiting for that
    #: actor's spawn (sent by its owner, it may arrive after a call from a third process),
    #: before refusing it.
    early_message_wait_s: float = 30.0
    #: How long a call of an actor mesh spawned under these settings may run before the
    #: actor is declared stuck, unless its endpoint or class sets a limit; None: no limit.
    call_limit_s: float | None = None
    #: Modules the fork server imports before forking procs (e.g. "torch").
    preload: tuple[str, ...] = ()
    #: Where named allocations (and the keys made for them) are kept; None: ~/.meshvisor.
    home: str | None = None
    #: The name of this host in supervision events (the `host` of events about procs here);
    #: a SLURM job sets its node's name, as several nodes may share one machine.
    host_name: str = field(default_factory=socket.gethostname)
    #: The fewest recipients of one call on one host for which this process sends the call
    #: once to that host's agent instead of to each proc (docs/fan-out.md); below it the extra
    #: hop costs more than the messages it saves (benchmarks/bench_fanout.py measured 32).
    fanout_min_recipients: int = 32
    #: The same for a call whose payload the host agent shares rather than copies to each
    #: proc (1 MiB and more, answers awaited; docs/fan-out.md): the payload then travels once
    #: to the host, which saves more than the hop costs from a few recipients on.
    fanout_min_shared_recipients: int = 4

    def __post_init__(self) -> None:
        for name in _DURATIONS:
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                object.__setattr__(self, name, seconds(name, value, zero=name in _MAY_BE_ZERO))
        if isinstance(self.preload, list):
            object.__setattr__(self, "preload", tuple(self.preload))
        if not isinstance(self.preload, tuple) or not all(
            isinstance(module, str) for module in self.preload
        ):
            raise TypeError(f"preload must be a tuple of module names, not {self.preload!r}")
        if self.home is not None and not isinstance(self.home, str):
            raise TypeError(f"home must be a directory path (str), not {self.home!r}")
        if not isinstance(self.host_name, str) or not self.host_name.strip():
            raise ValueError(f"host_name must be a non-empty name (str), not {self.host_name!r}")
        for name in _COUNTS:
            _check_count(name, getattr(self, name))
        self.heartbeats(None, None, None)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The settings named by MESHVISOR_* variables in `environ`; defaults for unset ones;
        a ValueError naming the variable for a bad value."""
        values: dict[str, object] = {}
        for name, variable in ENV_NAMES.items():
            raw = environ.get(variable)
            if raw is not None and (raw or name in _DURATIONS):
                values[name] = _parse(name, variable, raw)
        try:
            return cls(**values)  # type: ignore[arg-type]
        except ValueError as error:
            variables = ", ".join(ENV_NAMES[name] for name in _HEARTBEATS if name in values)
            raise ValueError(
                f"the environment variables {variables} disagree: {error}; fix or unset them"
            ) from None

    def to_env(self) -> dict[str, str]:
        """These settings as the environment variables a child process reads them from."""
        env: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value == ():
                continue
            env[ENV_NAMES[f.name]] = _written(value)
        return env

    @property
    def allocations_home(self) -> Path:
        """The directory named allocations live under (`home`, else ~/.meshvisor)."""
        return Path(self.home) if self.home is not None else Path.home() / ".meshvisor"

    def heartbeats(
        self, interval_s: float | None, timeout_s: float | None, busy_s: float | None
    ) -> tuple[float, float, float]:
        """(interval, timeout, busy timeout) of new procs: the given values, else these
        settings' (busy: at least the timeout unless set); each finite and > 0, and
        interval < timeout <= busy."""
        interval = (
            self.heartbeat_interval_s
            if interval_s is None
            else seconds("heartbeat_interval_s", interval_s)
        )
        timeout = (
            self.heartbeat_timeout_s
            if timeout_s is None
            else seconds("heartbeat_timeout_s", timeout_s)
        )
        busy = self.busy_timeout_s if busy_s is None else seconds("busy_timeout_s", busy_s)
        if busy is None:
            busy = max(DEFAULT_BUSY_TIMEOUT_S, timeout)
        if timeout <= interval:
            raise ValueError(
                f"heartbeat_timeout_s ({timeout:g}) must be longer than heartbeat_interval_s "
                f"({interval:g}), or every proc would be declared hung between two heartbeats"
            )
        if busy < timeout:
            raise ValueError(
                f"busy_timeout_s ({busy:g}) must be at least heartbeat_timeout_s ({timeout:g}): "
                "it is the longer limit given to procs that miss heartbeats while using CPU time"
            )
        return interval, timeout, busy


def _written(value: float | str | tuple[str, ...]) -> str:
    """`value` as an environment variable holds it (floats exactly, modules comma-separated)."""
    if isinstance(value, tuple):
        return ",".join(value)
    return value if isinstance(value, str) else repr(value)


def _check_count(name: str, value: object) -> None:
    """Raise unless `value` is a whole number >= 1 (the error names `name`)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number of recipients, not {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, not {value!r}")


def seconds(name: str, value: object, *, zero: bool = False) -> float:
    """`value` as a duration: a finite number of seconds > 0 (>= 0 if `zero`), else an error
    naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {value!r}")
    if not (math.isfinite(value) and (value > 0 or (zero and value == 0))):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, not {value!r}")
    return float(value)


def _parse(name: str, variable: str, raw: str) -> object:
    """The value of field `name` written as `raw` in environment variable `variable`."""
    if name == "preload":
        return tuple(module.strip() for module in raw.split(",") if module.strip())
    if name in _COUNTS:
        return _parse_count(variable, raw)
    if name not in _DURATIONS:
        return raw
    default = getattr(Settings, name, None) or DEFAULT_BUSY_TIMEOUT_S
    zero = name in _MAY_BE_ZERO
    try:
        return seconds(variable, float(raw), zero=zero)
    except ValueError:
        bound = ">= 0" if zero else "> 0"
        raise ValueError(
            f"environment variable {variable}={raw!r} must be a finite number of seconds "
            f"{bound} (e.g. {default:g}); fix or unset it"
        ) from None


def _parse_count(variable: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"environment variable {variable}={raw!r} must be a whole number >= 1 (e.g. 32); "
            "fix or unset it"
        )
    return value


_current: Settings | None = None


def current_settings() -> Settings:
    """This process's settings: the last ones configured, else those of its environment."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


def replace_current(settings: Settings | None) -> None:
    """Make `settings` this process's settings (None: read the environment again on next use)."""
    global _current
    _current = settings


def reload_settings() -> None:
    """Forget this process's settings and logger: read them from the environment again on next
    use (a proc after its agent set its environment)."""
    replace_current(None)
    use_transport_settings(None)
    reset_logging()
