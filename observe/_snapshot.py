"""`SnapshotReader`: asks host agents what they run, read-only, and gathers their answers.

It has no runtime and no session: it cannot own, spawn, stop or call anything. It binds one
private reply inbox (ipc in a private run directory; also tcp, CURVE-authenticated with the
allocation's keys, when some agent is on tcp), sends each agent a `SnapshotQuery` naming that
inbox, and waits a bounded time for the `HostSnapshot` answers. An agent that does not answer
in time is reported as unreachable, with the reason when one is known.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from mesh.tooling import HostSnapshot, SnapshotQuery, write_owner_file
from observe._targets import Target
from transport import (
    Inbox,
    Outbox,
    TransportError,
    close_context,
    encode,
    new_context,
    private_runtime_dir,
    tcp_address,
    use_curve_keys,
)

#: How long a snapshot waits for the agents' answers by default (seconds).
DEFAULT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Unreachable:
    """An agent that did not answer, and why as far as the viewer can tell."""

    agent: str
    reason: str


@dataclass(frozen=True)
class Snapshot:
    """What the agents of a target said at one moment (wall `time`), and who did not answer."""

    title: str
    time: float
    hosts: tuple[HostSnapshot, ...]
    unreachable: tuple[Unreachable, ...]


class SnapshotReader:
    """Takes snapshots of the agents of `target` (close it, or use it as a context manager)."""

    def __init__(
        self, target: Target, listen_host: str = "127.0.0.1", meshes: frozenset[str] = frozenset()
    ) -> None:
        self.meshes = meshes  # only the procs of these proc or actor meshes (empty: all)
        self._target = target
        if target.keys:
            use_curve_keys(target.keys)
        self._context: Any = new_context()
        self._rundir = private_runtime_dir("meshvisor-view-")
        self._outbox: Outbox | None = None
        self._inbox: Inbox | None = None
        self._query_id = 0
        try:
            write_owner_file(self._rundir)  # swept by the next meshvisor process if killed
            self._inbox = Inbox(self._context, f"ipc://{self._rundir}/view")
            self._reply_ipc = self._inbox.address
            self._reply_tcp = None
            if any(agent.startswith("tcp://") for agent in target.agents):
                self._reply_tcp = self._inbox.listen_also(tcp_address(listen_host))
            self._outbox = Outbox(self._context)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> SnapshotReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def take(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> Snapshot:
        """Ask every agent now; their answers within `timeout_s`, the others unreachable."""
        assert self._inbox is not None and self._outbox is not None
        self._query_id += 1
        failed: dict[str, str] = {}
        for agent in self._target.agents:
            reply_to = self._reply_tcp if agent.startswith("tcp://") else self._reply_ipc
            try:
                self._outbox.send(agent, encode(SnapshotQuery(reply_to or "", self._query_id)))
            except TransportError as error:
                failed[agent] = str(error)
        answers = self._gather(set(self._target.agents) - set(failed), timeout_s)
        unreachable = []
        for agent in self._target.agents:
            if agent not in answers:
                unreachable.append(Unreachable(agent, failed.get(agent) or self._why(agent)))
                self._outbox.forget(agent)  # no query piles up for it meanwhile
        hosts = tuple(
            _only(answers[a], self.meshes) if self.meshes else answers[a]
            for a in self._target.agents
            if a in answers
        )
        return Snapshot(self._target.title, time.time(), hosts, tuple(unreachable))

    def _gather(self, agents: set[str], timeout_s: float) -> dict[str, HostSnapshot]:
        """The answers to the current query from `agents`, until all came or time is up."""
        assert self._inbox is not None
        answers: dict[str, HostSnapshot] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < len(agents):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._inbox.poll(left_ms):
                break
            while (envelope := self._inbox.receive_nowait()) is not None:
                answer: Any = envelope.header
                if type(answer) is HostSnapshot and answer.query_id == self._query_id:
                    if answer.agent in agents:
                        answers[answer.agent] = answer
                    elif (alias := _bound_alias(answer.agent, agents)) is not None:
                        answers[alias] = answer
        return answers

    def _why(self, agent: str) -> str:
        """Why `agent` did not answer, as far as this side can tell."""
        assert self._outbox is not None
        refusal = self._outbox.refusal(agent)
        if refusal is not None:
            return f"it refused this viewer: {refusal}"
        if agent.startswith("ipc://") and not os.path.exists(agent[len("ipc://") :]):
            return "no agent listens there (its socket file is gone: it stopped)"
        return (
            "no answer in time: the agent is stopped, paused, overloaded or cut off (or runs "
            "a meshvisor without the live view)"
        )

    def close(self) -> None:
        """Close the sockets and remove the private run directory."""
        if self._outbox is not None:
            self._outbox.close(linger_ms=0)
            self._outbox = None
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None
        if self._context is not None:
            close_context(self._context)
            self._context = None
        shutil.rmtree(self._rundir, ignore_errors=True)


def _bound_alias(answered: str, asked: set[str]) -> str | None:
    """The address the user named for an agent that reports itself by another one (a tcp
    agent bound to ``0.0.0.0`` reports that address, not the one used to reach it)."""
    port = answered.rpartition(":")[2]
    matches = [a for a in asked if a.startswith("tcp://") and a.rpartition(":")[2] == port]
    return matches[0] if len(matches) == 1 else None


def _only(host: HostSnapshot, meshes: frozenset[str]) -> HostSnapshot:
    """`host` with only the procs of the proc or actor meshes named `meshes`, and their events."""
    procs = tuple(
        proc
        for proc in host.procs
        if proc.mesh_name in meshes or any(actor.mesh_name in meshes for actor in proc.actors)
    )
    kept = {proc.proc_id for proc in procs}
    events = tuple(e for e in host.events if e.proc_id in kept or e.mesh_name in meshes)
    return dataclasses.replace(host, procs=procs, events=events)
