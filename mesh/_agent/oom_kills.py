"""Was a SIGKILLed proc killed by the kernel's OOM killer? Its memory cgroup's counter says.

When a proc is ready the agent samples the oom_kill counter of the proc's memory cgroup
(cgroup v2 ``memory.events``, or v1 ``memory.oom_control``); a proc later SIGKILLed by no one
the agent knows of, while that counter went up, was OOM-killed, and its report gives the
cgroup's limit and peak usage. Linux only; a proc in a cgroup without a memory controller (the
root of a v2 hierarchy, a system without cgroups) is not sampled, and its SIGKILL stays one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mesh._engine.proc_faults import format_bytes

#: A v1 limit at least this large means no limit (the kernel's "unlimited" is about 2**63).
_UNLIMITED = 1 << 62


@dataclass(frozen=True, slots=True)
class CgroupMemory:
    """A memory cgroup (its directory, v1 or v2) and its oom_kill count when sampled."""

    path: str
    version: int
    oom_kills: int


def sample_memory_cgroup(pid: int) -> CgroupMemory | None:
    """The memory cgroup of process `pid` and its oom_kill count now; None where unknown."""
    path = _memory_cgroup_dir(pid)
    if path is None:
        return None
    version = 2 if os.path.exists(os.path.join(path, "memory.events")) else 1
    count = _oom_kills(path, version)
    return None if count is None else CgroupMemory(path, version, count)


def killed_by_oom(before: CgroupMemory) -> str:
    """Why the proc of cgroup `before` was OOM-killed (its count went up since), or ""."""
    now = _oom_kills(before.path, before.version)
    if now is None or now <= before.oom_kills:
        return ""
    limit_file, peak_file = (
        ("memory.max", "memory.peak")
        if before.version == 2
        else ("memory.limit_in_bytes", "memory.max_usage_in_bytes")
    )
    limit, peak = _bytes(before.path, limit_file), _bytes(before.path, peak_file)
    limit_text = "no memory limit" if limit is None else f"a memory limit of {format_bytes(limit)}"
    peak_text = "" if peak is None else f", peak usage {format_bytes(peak)}"
    return (
        f"the kernel's OOM killer killed it: its memory cgroup {before.path} has {limit_text}"
        f"{peak_text} (oom_kill count {before.oom_kills} -> {now})"
    )


def _memory_cgroup_dir(pid: int) -> str | None:
    """The directory of `pid`'s memory cgroup: its v1 memory hierarchy's, else its v2 one's."""
    try:
        with open(f"/proc/{pid}/cgroup") as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    paths: dict[str, str] = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            paths["v1"] = path
        elif controllers == "":
            paths["v2"] = path
    mounts = _cgroup_mounts(pid)
    for version in ("v1", "v2"):
        if version in paths and version in mounts:
            mountpoint, root = mounts[version]
            relative = paths[version]
            if root != "/" and relative.startswith(root):
                relative = relative[len(root) :]
            return os.path.join(mountpoint, relative.lstrip("/"))
    return None


def _cgroup_mounts(pid: int) -> dict[str, tuple[str, str]]:
    """Where the v1 memory and the v2 hierarchies are mounted: (mount point, root) each."""
    mounts: dict[str, tuple[str, str]] = {}
    try:
        with open(f"/proc/{pid}/mountinfo") as file:
            lines = file.read().splitlines()
    except OSError:
        return mounts
    for line in lines:
        fields, _, tail = line.partition(" - ")
        parts, tail_parts = fields.split(), tail.split()
        if len(parts) < 5 or len(tail_parts) < 3:
            continue
        if tail_parts[0] == "cgroup2":
            mounts.setdefault("v2", (parts[4], parts[3]))
        elif tail_parts[0] == "cgroup" and "memory" in tail_parts[2].split(","):
            mounts.setdefault("v1", (parts[4], parts[3]))
    return mounts


def _oom_kills(path: str, version: int) -> int | None:
    """The oom_kill count of the cgroup at `path`; None if it has none to read."""
    name = "memory.events" if version == 2 else "memory.oom_control"
    try:
        with open(os.path.join(path, name)) as file:
            for line in file:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def _bytes(path: str, name: str) -> int | None:
    """A size file of the cgroup at `path`, in bytes; None for "max", unlimited or unreadable."""
    try:
        with open(os.path.join(path, name)) as file:
            text = file.read().strip()
        value = int(text)
    except (OSError, ValueError):
        return None
    return None if value >= _UNLIMITED else value
