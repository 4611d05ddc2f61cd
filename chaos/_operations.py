"""The operations a chaos harness asks of the workload's client, which only the client can
carry out: resolve a target rank to its process, make an endpoint raise, make a process exit,
break links, cut off a host, and probe ranks until they answer again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mesh import ActorMesh, HostMesh, placement
from mesh.testing import break_links, exit_process, fail_next_call, heal_links, probe
from supervision import SupervisionError

from ._channel import Channel, Message
from ._errors import InjectedError, InjectedFault

#: How long one health probe waits for an answer before trying again.
PROBE_TIMEOUT_S = 1.0


@dataclass
class ChaosTarget:
    """An actor mesh chaos may aim at, with the heartbeat timeout of its procs."""

    actors: ActorMesh[Any]
    heartbeat_timeout_s: float


class Operations:
    """The client's side of the harness's requests, over the job's targets."""

    def __init__(
        self,
        targets: dict[str, ChaosTarget],
        hosts: HostMesh,
        agents: list[str],
        finish_run: threading.Event,
    ) -> None:
        self._targets = targets
        self._hosts = hosts
        self._agents = agents
        self._finish_run = finish_run
        self._table: dict[str, Callable[..., Any]] = {
            "resolve": self.resolve,
            "ranks_on": self.ranks_on,
            "raise": self.raise_in,
            "exit": self.exit,
            "links": self.links,
            "partition": self.partition,
            "wait_healthy": self.wait_healthy,
            "heal": self.heal,
            "finish": self.finish,
        }

    def serve(self, channel: Channel, request: Message) -> None:
        """Carry out `request` and answer it on `channel` (with its value or its error)."""
        handler = self._table.get(request["op"])
        if handler is None:
            channel.answer(request, error=f"unknown operation {request['op']!r}")
            return
        try:
            value = handler(**request["args"])
        except Exception as exc:
            channel.answer(request, error=f"{type(exc).__name__}: {exc}")
            return
        channel.answer(request, value)

    def host_of(self, agent: str | None) -> int | None:
        """The index of the host whose agent is `agent`, if it is one of the run's."""
        return self._agents.index(agent) if agent in self._agents else None

    def _rank(self, mesh: str, rank: int) -> ActorMesh[Any]:
        return self._targets[mesh].actors.flatten("rank").slice(rank=rank)

    def resolve(self, mesh: str, rank: int, timeout: float) -> dict[str, Any]:
        """The process that runs a rank now (waiting for it while it is being re-spawned)."""
        deadline = time.monotonic() + timeout
        while True:
            where = placement(self._targets[mesh].actors)[rank]
            if where.pid is not None and where.state == "ready":
                return {"pid": where.pid, "host": self.host_of(where.agent)}
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank} of {mesh!r} is not running ({where.state})")
            time.sleep(0.02)

    def ranks_on(self, host: int) -> list[list[Any]]:
        """Every target rank placed on `host`, with its current pid."""
        found = []
        for name, target in sorted(self._targets.items()):
            for where in placement(target.actors):
                if self.host_of(where.agent) == host:
                    found.append([name, where.rank, where.pid])
        return found

    def raise_in(self, mesh: str, rank: int, endpoint: str | None, fatal: bool) -> None:
        """Make the next call of `endpoint` on a rank raise (a fatal error fails the actor)."""
        error: BaseException = (
            InjectedFault(f"chaos: injected into {endpoint or 'the next call'}")
            if fatal
            else InjectedError(f"chaos: injected into {endpoint or 'the next call'}")
        )
        fail_next_call(self._rank(mesh, rank), error, endpoint).get(timeout=PROBE_TIMEOUT_S * 5)

    def exit(self, mesh: str, rank: int, code: int) -> None:
        """Make the process of a rank exit with `code`."""
        exit_process(self._rank(mesh, rank), code)

    def links(
        self,
        mesh: str,
        rank: int,
        duration_s: float,
        probability: float,
        delay_s: float,
        seed: int,
    ) -> None:
        """Drop or delay messages between the client and a rank for `duration_s`."""
        break_links(
            "client",
            self._rank(mesh, rank),
            duration_s=duration_s,
            probability=probability,
            delay_s=delay_s,
            seed=seed,
        )

    def partition(self, host: int, duration_s: float) -> None:
        """Cut `host` off from the client for `duration_s`."""
        break_links(self._hosts.slice(hosts=host), None, duration_s=duration_s, hold=True)

    def wait_healthy(
        self, ranks: list[list[Any]], exclude_pids: list[int], timeout: float
    ) -> dict[str, Any]:
        """Probe `ranks` until each answers from a process not in `exclude_pids`."""
        deadline = time.monotonic() + timeout
        pids = []
        for mesh, rank in ranks:
            pids.append(self._probe_until(self._rank(mesh, rank), set(exclude_pids), deadline))
        return {"at": time.monotonic(), "pids": pids}

    def heal(self, timeout: float) -> dict[str, Any]:
        """Remove every fault rule, then wait until every target rank answers."""
        heal_links()
        ranks = [
            [name, rank]
            for name, target in sorted(self._targets.items())
            for rank in range(len(target.actors))
        ]
        return self.wait_healthy(ranks, [], timeout)

    def finish(self) -> None:
        """End the workload's run (job.running() returns False)."""
        self._finish_run.set()

    def _probe_until(self, actors: ActorMesh[Any], exclude: set[int], deadline: float) -> int:
        last = "no answer yet"
        while time.monotonic() < deadline:
            try:
                pid = next(iter(probe(actors).get(timeout=PROBE_TIMEOUT_S).values()))
            except (SupervisionError, TimeoutError) as exc:
                last = str(exc)
            else:
                if pid not in exclude:
                    return int(pid)
                last = f"still answered by process {pid}, which should be gone"
            time.sleep(0.02)
        raise TimeoutError(f"{actors.name} did not become healthy: {last}")
