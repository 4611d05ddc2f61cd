"""Spare hosts of a `ReplicaGroup`: where a replica whose host is lost comes back.

A SLURM job may hold a node or more in reserve (``SlurmJob({"trainers": 3, "spare": 1})``);
each spare host replaces one lost host, once.
"""

from __future__ import annotations

from mesh import HostMesh
from supervision import SupervisionError, SupervisionEvent


class SparePool:
    """The spare hosts not taken yet, one host mesh each, in the order of `hosts`."""

    def __init__(self, hosts: HostMesh | None) -> None:
        self._free: list[HostMesh] = []
        if hosts is not None and "hosts" in hosts.extent.labels:
            count = hosts.extent.sizes[hosts.extent.labels.index("hosts")]
            self._free = [hosts.slice(hosts=index) for index in range(count)]
        elif hosts is not None:
            self._free = [hosts]

    def take(self) -> HostMesh | None:
        """The next spare host (no longer spare afterwards), or None if none is left."""
        return self._free.pop(0) if self._free else None

    def __len__(self) -> int:
        return len(self._free)


def host_lost(failure: BaseException | SupervisionEvent) -> bool:
    """Whether `failure` (an event, or a call's error) says a replica's host is lost: its
    agent died or went silent ("unreachable"), as when its node dies."""
    if isinstance(failure, SupervisionError):
        failure = failure.event
    return isinstance(failure, SupervisionEvent) and failure.kind == "unreachable"
