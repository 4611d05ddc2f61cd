"""What every mesh handle shares: array-like slicing, `with`-block stopping, names, and how
a handle travels to another process (its procs are adopted there)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from types import TracebackType
from typing import Any, TypeVar

from mesh._engine.future import Future
from mesh._engine.messages import WatchProcs
from mesh._engine.peers import ProcPeer
from mesh._engine.runtime import Runtime, listen_towards
from mesh._shape import Sliceable
from supervision import SupervisionError

A = TypeVar("A")
DEFAULT_STOP_GRACE_S = 5.0
#: The longest mesh name spawn_procs and spawn accept.
MAX_NAME_LEN = 255


def check_name(what: str, name: object) -> None:
    """Refuse a mesh name that is not a short, printable string without '/'."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a {what} needs a non-empty name (a str), got {name!r}")
    if len(name) > MAX_NAME_LEN:
        raise ValueError(
            f"the {what} name {name[:40]!r}... is {len(name)} characters long; "
            f"use at most {MAX_NAME_LEN}"
        )
    if "/" in name or not name.isprintable():
        raise ValueError(
            f"the {what} name {name!r} contains '/' or a control character; use a name without them"
        )


def file_safe(name: str) -> str:
    """A short prefix for proc ids (which name socket files) that reads like `name`."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:20].lstrip(".-") or "procs"


class MeshBase(Sliceable):
    """What every mesh handle shares: an extent and array-like slicing (see `Sliceable`)."""


class Stoppable:
    """`async with` / `with` support: leaving the block stops the mesh."""

    def stop(self) -> Future[None]:
        raise NotImplementedError

    def __enter__(self: A) -> A:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop().get()

    async def __aenter__(self: A) -> A:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


def wait_ready(peers: Iterable[ProcPeer], timeout: float = 60.0) -> None:
    """Wait until these procs have an address (or are gone), so a pickled handle can reach
    them from elsewhere."""
    for peer in peers:
        if peer.alive and peer.address is None:
            try:
                peer.ready.get(timeout)
            except SupervisionError:
                pass


def peer_infos(peers: Iterable[ProcPeer]) -> tuple[tuple[Any, ...], ...]:
    """What a pickled handle carries of each proc, for `adopt_peers` on the other side."""
    return tuple((p.proc_id, p.mesh_name, p.point, p.agent, p.address) for p in peers)


def adopt_peers(runtime: Runtime, infos: tuple[tuple[Any, ...], ...]) -> tuple[ProcPeer, ...]:
    """Peers for a mesh handle received from elsewhere; their agents will tell us if they die."""
    peers = []
    watch: dict[str, list[str]] = {}
    tcp = None  # a new peer reached over tcp: its answers must reach this process from there
    for proc_id, mesh_name, point, agent, address in infos:
        peer = runtime.ownership.peer(proc_id)
        if peer is None:
            peer = runtime.ownership.add_peer(ProcPeer(proc_id, mesh_name, point, agent, address))
            if agent is not None:
                watch.setdefault(agent, []).append(proc_id)
            if tcp is None and peer.location is not None and peer.location.startswith("tcp://"):
                tcp = peer.location
        peers.append(peer)
    if tcp is not None:
        listen_towards(runtime, tcp)
    for agent, proc_ids in watch.items():
        runtime.send_message(agent, WatchProcs(tuple(proc_ids), runtime.address_for(agent)))
    return tuple(peers)
