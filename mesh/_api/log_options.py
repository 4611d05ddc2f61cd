"""`ProcMesh.logging_option` and `ProcMesh.flush_logs`: where a proc mesh's output goes."""

from __future__ import annotations

import logging
import math
from typing import Any

from mesh._engine.future import Future
from mesh._engine.log_messages import SetProcLogLevel
from mesh._engine.ownership import ProcMeshRecord
from mesh._engine.peers import ProcPeer
from mesh._engine.proc_output import LogMode
from mesh._engine.runtime import Runtime


def check_logging_option(
    stream_to_client: Any, aggregate_window_sec: Any, level: Any, aggregate_similar: Any = True
) -> LogMode:
    """The mode these arguments ask for; ValueError/TypeError saying what is wrong."""
    if not isinstance(stream_to_client, bool):
        raise TypeError(f"stream_to_client must be True or False, not {stream_to_client!r}")
    if not isinstance(aggregate_similar, bool):
        raise TypeError(f"aggregate_similar must be True or False, not {aggregate_similar!r}")
    window = aggregate_window_sec
    if window is not None and (
        isinstance(window, bool)
        or not isinstance(window, (int, float))
        or not math.isfinite(window)
        or window <= 0
    ):
        raise ValueError(
            f"aggregate_window_sec must be a number of seconds > 0, or None (no aggregation), "
            f"not {window!r}"
        )
    if window is not None and not stream_to_client:
        raise ValueError(
            "aggregate_window_sec aggregates the lines streamed to the client; with "
            "stream_to_client=False pass aggregate_window_sec=None"
        )
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 255:
        raise ValueError(
            f"level must be a logging level between 0 and 255 (logging.INFO is "
            f"{logging.INFO}), not {level!r}"
        )
    return LogMode(stream_to_client, None if window is None else float(window), aggregate_similar)


def owned_record(runtime: Runtime, peers: tuple[ProcPeer, ...], name: str) -> ProcMeshRecord:
    """The record of the proc mesh of `peers`, which this process must have spawned."""
    record = runtime.ownership.proc_mesh(peers[0].mesh_key) if peers[0].agent else None
    if record is None:
        raise ValueError(
            f"the output of proc mesh {name!r} can only be set by the process that spawned it "
            "(this_proc() and meshes received from others have none to set)"
        )
    return record


def set_logging_option(
    runtime: Runtime, record: ProcMeshRecord, mode: LogMode, level: int
) -> Future[None]:
    """Forward the lines of `record`'s procs here from now on, shown as `mode` says, and set
    their root logger's `level`; done once the lines they printed before are shown."""
    runtime.output.set_mode(record.key, mode)
    record.forward_output = mode.stream_to_client
    record.quiet_output = not mode.stream_to_client  # the lines stay in the log files
    alive = [peer for peer in record.peers if peer.alive]
    runtime.calls.send_to_procs([(peer, SetProcLogLevel(level)) for peer in alive], None, None)
    return runtime.output.sync(list(record.peers), record.forward_output, record.quiet_output)


def flush_logs(runtime: Runtime, record: ProcMeshRecord) -> Future[None]:
    """Done once every line `record`'s procs printed before this call is shown (aggregated
    lines at once, without waiting for their window)."""
    return runtime.output.sync(list(record.peers), record.forward_output, record.quiet_output)
