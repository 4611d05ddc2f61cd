"""Monarch's `configure` keys, read as meshvisor's settings where one means the same thing.

A ported script may call ``configure(mesh_orphan_timeout="30s")``: such a key is translated
(humantime durations to seconds). A Monarch key with no meshvisor counterpart is refused with
an error that says what to use instead, never ignored.
"""

from __future__ import annotations

import re
from collections.abc import Callable

#: Monarch key -> (meshvisor setting, how its value converts).
_Translation = tuple[str, Callable[[str, object], object]]

_DURATION_UNITS = {
    "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0,
    "h": 3600.0, "hr": 3600.0, "d": 86400.0,
}  # fmt: skip
_DURATION_PART = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*")


def humantime_seconds(key: str, value: object) -> object:
    """A Monarch duration (``"30s"``, ``"1h 30m"``, ``"500ms"``, or a number of seconds) in
    seconds; a ValueError naming `key` for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip():
        total, position = 0.0, 0
        for part in _DURATION_PART.finditer(value):
            if part.start() != position or part.group(2) not in _DURATION_UNITS:
                break
            total += float(part.group(1)) * _DURATION_UNITS[part.group(2)]
            position = part.end()
        else:
            if position == len(value):
                return total
    raise ValueError(
        f"{key} must be a duration such as '30s', '5m' or '1h 30m' (or a number of seconds), "
        f"not {value!r}"
    )


def _as_is(key: str, value: object) -> object:
    return value


TRANSLATED: dict[str, _Translation] = {
    "mesh_orphan_timeout": ("orphan_timeout_s", humantime_seconds),
    "codec_max_frame_length": ("max_message_bytes", _as_is),
}

_HEARTBEATS = (
    "meshvisor notices a proc that does not start or stops answering by its heartbeats: "
    "set heartbeat_timeout_s (and busy_timeout_s), or the same arguments of spawn_procs"
)
_STOPPING = "meshvisor's stop takes its grace period per call: ProcMesh.stop(grace_s=...)"
_WAITING = "meshvisor calls wait as long as their caller says: Future.get(timeout=...)"
_LOGS = (
    "meshvisor relays proc output to the client per proc mesh (Monarch's "
    "ProcMesh.logging_option); log_level and log_format set this process's own log"
)
_TRANSPORT = (
    "meshvisor picks its transport itself: ipc between processes of one host, tcp with CURVE "
    "authentication between hosts"
)
#: Monarch keys with no counterpart here, and what to use instead.
INSTEAD: dict[str, str] = {
    **dict.fromkeys(
        (
            "host_spawn_ready_timeout",
            "mesh_proc_spawn_max_idle",
            "actor_spawn_max_idle",
            "get_actor_state_max_idle",
            "get_proc_state_max_idle",
            "supervision_watchdog_timeout",
        ),
        _HEARTBEATS,
    ),
    **dict.fromkeys(
        (
            "process_exit_timeout",
            "stop_actor_timeout",
            "cleanup_timeout",
            "mesh_terminate_timeout",
            "proc_stop_max_idle",
        ),
        _STOPPING,
    ),
    **dict.fromkeys(("message_delivery_timeout", "message_ttl_default"), _WAITING),
    **dict.fromkeys(
        (
            "enable_log_forwarding",
            "enable_file_capture",
            "tail_log_lines",
            "read_log_buffer",
            "force_file_log",
            "prefix_with_rank",
        ),
        _LOGS,
    ),
    **dict.fromkeys(
        ("default_transport", "channel_tcp_congestion", "default_encoding"), _TRANSPORT
    ),
    "remote_alloc_bind_to_inaddr_any": (
        "meshvisor agents listen on loopback unless started with `meshvisor agent --listen`"
    ),
    "mesh_bootstrap_enable_pdeathsig": "meshvisor procs always die with their host agent",
    **dict.fromkeys(
        (
            *("message_ack_time_interval", "message_ack_every_n_messages"),
            *("split_max_buffer_size", "split_max_buffer_age", "small_write_threshold"),
            *("channel_net_rx_buffer_full_check_interval", "message_latency_sampling_rate"),
            *("enable_dest_actor_reordering_buffer", "mesh_terminate_concurrency"),
            *("max_cast_dimension_size", "remote_alloc_bootstrap_addr", "mesh_admin_addr"),
            *("remote_alloc_allowed_port_range", "mesh_attach_config_timeout", "pyspy_bin"),
            *("rdma_allow_tcp_fallback", "rdma_disable_ibverbs", "rdma_max_chunk_size_mb"),
            *("rdma_ibverbs_target", "rdma_peer_device_affinity", "rdma_max_nics_per_buffer"),
            *("rdma_min_stripe_size_kb", "rdma_qps_per_cq", "rdma_cq_poller_per_device"),
            "rdma_runtime_worker_threads",
        ),
        "it tunes Monarch's Rust runtime, which meshvisor does not have; leave it out",
    ),
}


def translate(changes: dict[str, object]) -> dict[str, object]:
    """`changes` with Monarch keys renamed to meshvisor's and their values converted; a
    TypeError for a Monarch key that has no counterpart, or one given under both names."""
    refused = sorted(key for key in changes if key in INSTEAD)
    if refused:
        advice = "; ".join(f"{key}: {INSTEAD[key]}" for key in refused)
        raise TypeError(
            f"Monarch setting(s) {', '.join(refused)} have no meshvisor equivalent ({advice})"
        )
    translated: dict[str, object] = {}
    for key, value in changes.items():
        ours, convert = TRANSLATED.get(key, (key, _as_is))
        if ours in translated or (ours != key and ours in changes):
            raise TypeError(f"{key} and {ours} set the same setting: give only {ours}")
        translated[ours] = convert(key, value)
    return translated
