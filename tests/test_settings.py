"""Settings: built from MESHVISOR_* variables and validated, overridden in code and in tests,
and passed on to the agents and procs a client starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mesh
import transport
from mesh import Settings, this_host
from mesh.testing import settings as overridden
from transport import TransportSettings


def test_the_defaults_are_those_the_readme_documents() -> None:
    defaults = Settings()
    assert (defaults.heartbeat_interval_s, defaults.heartbeat_timeout_s) == (0.25, 2.0)
    assert (defaults.orphan_timeout_s, defaults.agent_timeout_s) == (1.0, 2.0)
    assert (defaults.restart_wait_s, defaults.owner_alive_interval_s) == (30.0, 0.5)
    assert defaults.preload == () and defaults.allocations_home == Path.home() / ".meshvisor"
    assert (defaults.fanout_min_recipients, defaults.fanout_min_shared_recipients) == (32, 4)
    assert TransportSettings() == TransportSettings(1 << 30, "warning", "console", None)
    assert (
        Settings.from_env({}) == defaults and TransportSettings.from_env({}) == TransportSettings()
    )


def test_a_long_heartbeat_timeout_raises_the_default_busy_limit() -> None:
    """busy_timeout_s defaults to 60 s, or to the heartbeat timeout where that is longer."""
    assert Settings().heartbeats(None, None, None) == (0.25, 2.0, 60.0)
    assert Settings().heartbeats(None, 120.0, None) == (0.25, 120.0, 120.0)
    assert Settings(heartbeat_timeout_s=120.0).heartbeats(None, None, None)[2] == 120.0
    assert Settings(busy_timeout_s=10.0).heartbeats(None, 3.0, None) == (0.25, 3.0, 10.0)


def test_every_variable_is_read() -> None:
    environ = {
        "MESHVISOR_HEARTBEAT_INTERVAL_S": "0.5",
        "MESHVISOR_HEARTBEAT_TIMEOUT_S": "4",
        "MESHVISOR_BUSY_TIMEOUT_S": "8",
        "MESHVISOR_ORPHAN_TIMEOUT_S": "0",
        "MESHVISOR_AGENT_TIMEOUT_S": "3",
        "MESHVISOR_OWNER_ALIVE_INTERVAL_S": "0.2",
        "MESHVISOR_RESTART_WAIT_S": "9",
        "MESHVISOR_PRELOAD": "json, decimal,",
        "MESHVISOR_HOME": "/srv/meshvisor",
        "MESHVISOR_FANOUT_MIN_RECIPIENTS": "4",
        "MESHVISOR_FANOUT_MIN_SHARED_RECIPIENTS": "3",
        "MESHVISOR_MAX_MESSAGE_BYTES": "65536",
        "MESHVISOR_LOG_LEVEL": "INFO",
        "MESHVISOR_LOG_FORMAT": "json",
        "MESHVISOR_CURVE_KEYS": "/srv/keys",
    }
    assert Settings.from_env(environ) == Settings(
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=4.0,
        busy_timeout_s=8.0,
        orphan_timeout_s=0.0,
        agent_timeout_s=3.0,
        owner_alive_interval_s=0.2,
        restart_wait_s=9.0,
        preload=("json", "decimal"),
        home="/srv/meshvisor",
        fanout_min_recipients=4,
        fanout_min_shared_recipients=3,
    )
    assert TransportSettings.from_env(environ) == TransportSettings(
        65536, "info", "json", "/srv/keys"
    )


@pytest.mark.parametrize("value", ["nan", "-2", "0", "two seconds", ""])
@pytest.mark.parametrize("name", ["HEARTBEAT_TIMEOUT_S", "RESTART_WAIT_S", "AGENT_TIMEOUT_S"])
def test_a_bad_duration_in_the_environment_is_refused_naming_it(name: str, value: str) -> None:
    """A negative timeout would kill every proc at once as hung, nan would turn hang detection
    off: the error names the variable and its value."""
    error = f"environment variable MESHVISOR_{name}={value!r} must be a finite number of seconds"
    with pytest.raises(ValueError, match=re.escape(error)):
        Settings.from_env({f"MESHVISOR_{name}": value})


@pytest.mark.parametrize(
    ("variable", "value", "error"),
    [
        ("MESHVISOR_MAX_MESSAGE_BYTES", "1 GiB", "must be a whole number of bytes > 0"),
        ("MESHVISOR_MAX_MESSAGE_BYTES", "-1", "must be a whole number of bytes > 0"),
        ("MESHVISOR_LOG_LEVEL", "loud", "must be one of debug, info, warning, error, critical"),
        ("MESHVISOR_LOG_FORMAT", "xml", "must be one of console, json"),
    ],
)
def test_bad_transport_variables_are_refused_naming_them(
    variable: str, value: str, error: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{variable}={value!r} {error}")):
        TransportSettings.from_env({variable: value})


@pytest.mark.parametrize("value", ["0", "-3", "many", "2.5"])
def test_a_bad_fanout_threshold_in_the_environment_is_refused_naming_it(value: str) -> None:
    error = f"MESHVISOR_FANOUT_MIN_RECIPIENTS={value!r} must be a whole number >= 1"
    with pytest.raises(ValueError, match=re.escape(error)):
        Settings.from_env({"MESHVISOR_FANOUT_MIN_RECIPIENTS": value})


def test_heartbeat_variables_that_disagree_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="MESHVISOR_HEARTBEAT_INTERVAL_S disagree"):
        Settings.from_env({"MESHVISOR_HEARTBEAT_INTERVAL_S": "5"})
    with pytest.raises(ValueError, match=re.escape("busy_timeout_s (1) must be at least")):
        Settings.from_env({"MESHVISOR_BUSY_TIMEOUT_S": "1"})


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"restart_wait_s": -1.0}, "restart_wait_s must be a finite number of seconds > 0"),
        ({"orphan_timeout_s": float("inf")}, "orphan_timeout_s must be a finite number"),
        ({"agent_timeout_s": "2"}, "agent_timeout_s must be a number of seconds"),
        ({"heartbeat_interval_s": 3.0}, "heartbeat_timeout_s (2) must be longer than"),
        ({"preload": "torch"}, "preload must be a tuple of module names"),
        ({"fanout_min_recipients": 0}, "fanout_min_recipients must be at least 1, not 0"),
        ({"fanout_min_recipients": 2.0}, "fanout_min_recipients must be a whole number"),
        (
            {"fanout_min_shared_recipients": 0},
            "fanout_min_shared_recipients must be at least 1, not 0",
        ),
        ({"max_message_bytes": 0}, "max_message_bytes must be a number of bytes > 0"),
        ({"log_level": "loud"}, "log_level must be one of debug"),
        ({"restart_wait": 1.0}, "unknown setting(s) restart_wait: the settings are "),
    ],
)
def test_a_bad_override_is_refused_and_changes_nothing(
    changes: dict[str, object], error: str
) -> None:
    before = mesh.current_settings(), transport.transport_settings()
    with pytest.raises((TypeError, ValueError), match=re.escape(error)):
        mesh.configure(**{"agent_timeout_s": 5.0, **changes})
    assert (mesh.current_settings(), transport.transport_settings()) == before


def test_an_override_lasts_for_its_block() -> None:
    before = mesh.current_settings(), transport.transport_settings()
    with overridden(restart_wait_s=0.5, log_level="error", preload=["json"]) as settings:
        assert settings == mesh.current_settings()
        assert (settings.restart_wait_s, settings.preload) == (0.5, ("json",))
        assert transport.transport_settings().log_level == "error"
        assert settings.agent_timeout_s == before[0].agent_timeout_s  # the others stay
    assert (mesh.current_settings(), transport.transport_settings()) == before


def test_the_client_names_its_host_as_the_settings_do() -> None:
    """On a SLURM node the client's context names the node (MESHVISOR_HOST_NAME), as the
    agents there name theirs, not the machine's host name."""
    name = f"node-{uuid.uuid4().hex[:8]}"
    with overridden(host_name=name):
        assert mesh.context().host == name


def test_spawn_procs_takes_its_heartbeat_defaults_from_the_current_settings() -> None:
    with (
        overridden(heartbeat_timeout_s=5.0),
        pytest.raises(ValueError, match=re.escape("busy_timeout_s (1) must be at least")),
    ):
        this_host().spawn_procs(per_host={"gpus": 1}, busy_timeout_s=1.0)


PROPAGATION_SCRIPT = """
import mesh, transport
from mesh import Actor, endpoint, this_host

class Probe(Actor):
    @endpoint
    def settings(self):
        limit = transport.transport_settings().max_message_bytes
        return mesh.current_settings().restart_wait_s, limit

mesh.configure(restart_wait_s=7.0, max_message_bytes=12345678)
procs = this_host().spawn_procs(per_host={"gpus": 1})
print("RESULT", procs.spawn("probe", Probe).settings.call_one().get(timeout=30), flush=True)
"""


def test_an_override_reaches_the_procs_of_an_agent_started_after_it(tmp_path: Path) -> None:
    """Procs are other processes: the client's overrides reach them through the environment
    of the local agent it starts."""
    script = tmp_path / f"client-{uuid.uuid4().hex[:6]}.py"
    script.write_text(PROPAGATION_SCRIPT)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MESHVISOR_")}
    result = subprocess.run(
        [sys.executable, str(script)], env=environ, capture_output=True, text=True, timeout=90
    )
    assert result.returncode == 0, result.stderr
    assert "RESULT (7.0, 12345678)" in result.stdout, result.stdout


_durations = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False)
_modules = st.lists(st.from_regex(r"[a-z_][a-z0-9_]{0,8}(\.[a-z_][a-z0-9_]{0,8})?", fullmatch=True))
_paths = st.none() | st.from_regex(r"/[a-zA-Z0-9_./-]{1,30}", fullmatch=True)


@st.composite
def valid_settings(draw: st.DrawFn) -> Settings:
    interval, timeout, busy = sorted(draw(st.lists(_durations, min_size=3, max_size=3)))
    if interval == timeout:
        timeout = interval * 2
    return Settings(
        heartbeat_interval_s=interval,
        heartbeat_timeout_s=timeout,
        busy_timeout_s=draw(st.none() | st.just(max(busy, timeout))),
        orphan_timeout_s=draw(st.just(0.0) | _durations),
        agent_timeout_s=draw(_durations),
        owner_alive_interval_s=draw(_durations),
        restart_wait_s=draw(_durations),
        preload=tuple(draw(_modules)),
        home=draw(_paths),
        fanout_min_recipients=draw(st.integers(1, 1 << 40)),
        fanout_min_shared_recipients=draw(st.integers(1, 1 << 40)),
    )


@given(valid_settings())
def test_settings_survive_the_environment(settings: Settings) -> None:
    """What a client writes into an agent's environment is what the agent reads back."""
    assert Settings.from_env(settings.to_env()) == settings


@given(
    st.builds(
        TransportSettings,
        max_message_bytes=st.integers(min_value=1, max_value=1 << 40),
        log_level=st.sampled_from(("debug", "info", "warning", "error", "critical")),
        log_format=st.sampled_from(("console", "json")),
        curve_keys=_paths,
    )
)
def test_transport_settings_survive_the_environment(settings: TransportSettings) -> None:
    assert TransportSettings.from_env(settings.to_env()) == settings
