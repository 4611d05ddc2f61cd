"""`mesh.configured`: settings for one block (Monarch's name), Monarch's keys where they map
onto meshvisor's, and clear refusals that change nothing."""

from __future__ import annotations

import re
from typing import Any

import actors
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mesh
import transport
from mesh import Settings

T = 30


def snapshot() -> tuple[Settings, transport.TransportSettings]:
    return mesh.current_settings(), transport.transport_settings()


def test_configured_changes_the_settings_for_its_block_only() -> None:
    before = snapshot()
    with mesh.configured(restart_wait_s=4.0, log_level="error") as inside:
        assert inside is mesh.current_settings()  # the object the environment feeds
        assert inside.restart_wait_s == 4.0
        assert transport.transport_settings().log_level == "error"
        assert inside.agent_timeout_s == before[0].agent_timeout_s
    assert snapshot() == before


def test_configured_restores_the_settings_when_its_block_raises() -> None:
    before = snapshot()
    with pytest.raises(KeyError), mesh.configured(restart_wait_s=9.0):
        raise KeyError("inside")
    assert snapshot() == before


def test_nested_blocks_restore_in_order() -> None:
    before = snapshot()
    with mesh.configured(restart_wait_s=3.0):
        with mesh.configured(restart_wait_s=5.0, agent_timeout_s=7.0):
            assert mesh.current_settings().restart_wait_s == 5.0
        assert mesh.current_settings().restart_wait_s == 3.0
        assert mesh.current_settings().agent_timeout_s == before[0].agent_timeout_s
    assert snapshot() == before


def test_monarch_key_names_map_onto_meshvisor_settings() -> None:
    with mesh.configured(mesh_orphan_timeout="1m 30s", codec_max_frame_length=4096) as inside:
        assert inside.orphan_timeout_s == 90.0
        assert transport.transport_settings().max_message_bytes == 4096


UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 90), st.sampled_from(sorted(UNITS))), min_size=1))
def test_monarch_durations_are_read_as_seconds(parts: list[tuple[int, str]]) -> None:
    text = " ".join(f"{count}{unit}" for count, unit in parts)
    expected = sum(count * UNITS[unit] for count, unit in parts)
    if expected == 0:
        with mesh.configured(mesh_orphan_timeout=text) as inside:  # 0 is allowed: SIGKILL now
            assert inside.orphan_timeout_s == 0.0
        return
    with mesh.configured(mesh_orphan_timeout=text) as inside:
        assert inside.orphan_timeout_s == pytest.approx(expected)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"restart_wait": 1.0}, "unknown setting(s) restart_wait: the settings are "),
        ({"restart_wait_s": "soon"}, "restart_wait_s must be a number of seconds, not 'soon'"),
        ({"mesh_orphan_timeout": "30"}, "mesh_orphan_timeout must be a duration such as '30s'"),
        ({"mesh_orphan_timeout": "5 parsecs"}, "mesh_orphan_timeout must be a duration"),
        ({"codec_max_frame_length": 0}, "(Monarch's codec_max_frame_length is max_message_bytes)"),
        ({"enable_log_forwarding": True}, "enable_log_forwarding have no meshvisor equivalent"),
        ({"default_transport": "tcp"}, "ipc between processes of one host, tcp with CURVE"),
        ({"stop_actor_timeout": "5s"}, "ProcMesh.stop(grace_s=...)"),
        ({"host_spawn_ready_timeout": "5s"}, "set heartbeat_timeout_s"),
        ({"rdma_qps_per_cq": 8}, "it tunes Monarch's Rust runtime"),
        (
            {"mesh_orphan_timeout": "1s", "orphan_timeout_s": 2.0},
            "mesh_orphan_timeout and orphan_timeout_s set the same setting",
        ),
    ],
)
def test_a_bad_key_or_value_is_refused_naming_it_and_changes_nothing(
    changes: dict[str, object], error: str
) -> None:
    before = snapshot()
    with (
        pytest.raises((TypeError, ValueError), match=re.escape(error)),
        mesh.configured(agent_timeout_s=5.0, **changes),
    ):
        pass
    assert snapshot() == before


def test_mesh_testing_settings_is_configured() -> None:
    assert mesh.testing.settings is mesh.configured


def test_the_running_runtime_uses_the_block_settings(make_procs: Any) -> None:
    """A message-size limit set for a block applies to calls made in it, and only there."""
    echo = make_procs({"gpus": 1}).spawn("echo", actors.Echo)
    big = b"x" * 100_000
    assert echo.echo.call_one(big).get(timeout=T) == big
    with (
        mesh.configured(codec_max_frame_length=10_000),
        pytest.raises(transport.MessageTooLarge, match="exceeds the limit of 10000 bytes"),
    ):
        echo.echo.call_one(big).get(timeout=T)
    assert echo.echo.call_one(big).get(timeout=T) == big
