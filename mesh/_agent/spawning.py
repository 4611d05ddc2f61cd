"""How the host agent starts a proc: where it will listen, and the configuration and output
prefix the fork server hands it."""

from __future__ import annotations

import base64
import os
import shlex
from typing import Any

from mesh._engine.messages import ProcSpec, SpawnProcs
from mesh._engine.workspace_files import WORKSPACES_ENV, workspaces_root

#: The longest unix socket path (sun_path holds 108 bytes with the NUL), less the room a
#: proc's reply inboxes add to its own ("-r" and a number).
_MAX_SOCKET_PATH = 107 - 6


def proc_address(agent_address: str, rundir: str, proc_id: str) -> str:
    """Where a new proc listens: next to its agent (ipc), or on the agent's interface (tcp)."""
    if agent_address.startswith("tcp://"):
        return f"tcp://{agent_address[len('tcp://') :].rsplit(':', 1)[0]}:*"
    return f"ipc://{rundir}/{proc_id}"


def socket_path_too_long(address: str) -> str | None:
    """Why a proc cannot listen at ipc `address` (a path too long for a unix socket), or None."""
    if not address.startswith("ipc://"):
        return None
    length = len(os.fsencode(address[len("ipc://") :]))
    if length <= _MAX_SOCKET_PATH:
        return None
    return (
        f"its socket path {address[len('ipc://') :]!r} is {length} bytes long, over the "
        f"{_MAX_SOCKET_PATH}-byte limit of unix socket paths; give the host agent a shorter "
        "run directory (--rundir, or a shorter XDG_RUNTIME_DIR or TMPDIR)"
    )


def proc_config(
    request: SpawnProcs, spec: ProcSpec, address: str, agent_address: str, rundir: str
) -> dict[str, Any]:
    """What the proc `spec` of `request` needs to start (`proc_main.run_proc` reads it)."""
    return {
        "proc_id": spec.proc_id,
        "mesh_name": spec.mesh_name,
        "labels": spec.labels,
        "sizes": spec.sizes,
        "rank": spec.rank,
        "address": address,
        "owner": request.owner,
        "agent": agent_address,
        "rundir": rundir,
        "env": {**dict(request.env), WORKSPACES_ENV: os.path.realpath(workspaces_root(rundir))},
        "sys_path": [*workspace_paths(rundir), *request.sys_path],
        "cwd": request.cwd,
        "heartbeat_interval_s": request.heartbeat_interval_s,
        "bootstrap": list(request.bootstrap),
        "forward_output": request.forward_output,
        "quiet_output": request.quiet_output,
        "setup": base64.b64encode(request.setup).decode(),
        "memory_limit": request.memory_limit,
    }


def workspace_paths(rundir: str) -> list[str]:
    """The workspaces synced to this agent (``HostMesh.sync_workspace``), by name: they come
    first on a new proc's ``sys.path``, so that its imports find the synced code."""
    root = workspaces_root(rundir)
    try:
        names = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    except OSError:
        return []
    return [os.path.join(os.path.realpath(root), name) for name in names if name[0] != "."]


def bootstrap_failure(command: tuple[str, ...], code: int, signame: str | None, hung: bool) -> str:
    """Why the proc of bootstrap `command` (`SpawnProcs.bootstrap`) failed to join its mesh,
    when its process ended with `code` (killed by `signame`, hung: never connected)."""
    shown = shlex.join([command[0], *command[2:]])
    if hung:
        ended = "never connected to its agent and was killed"
    elif signame is not None:
        ended = f"was killed by {signame} before its proc connected"
    else:
        ended = f"exited with code {code} before its proc connected"
    return (
        f"the bootstrap command {shown!r} {ended}; it must run `python -m mesh.bootstrap_main` "
        "with meshvisor importable (its output above may say why)"
    )


def output_prefix(spec: ProcSpec) -> str:
    """What starts each line the proc prints: its mesh and point, e.g. ``trainers {'gpus': 1}``."""
    point = dict(zip(spec.labels, _coords(spec.sizes, spec.rank)))
    return f"{spec.mesh_name} {point}"


def _coords(sizes: tuple[int, ...], rank: int) -> list[int]:
    """The coordinates of `rank` in a row-major mesh of `sizes`."""
    coords = []
    for size in reversed(sizes):
        rank, index = divmod(rank, size)
        coords.append(index)
    return list(reversed(coords))
