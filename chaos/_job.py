"""`Job`: the workload's side of a chaos run, in the client process the harness started.

The workload spawns its meshes on ``job.hosts``, names the actor meshes chaos may aim at with
``job.target(...)``, registers its invariants and loops ``while job.running():``. Meanwhile the
job reports every supervision event and the workload's progress to the harness, and carries
out what the harness asks for that only the client can do: resolve a target to its process,
make an endpoint raise, break links, probe health.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from mesh import ActorMesh, HostMesh, placement
from supervision import SupervisionEvent, add_event_listener

from ._channel import Channel, Message
from ._faults import DEFAULT_HEARTBEAT_TIMEOUT_S
from ._operations import ChaosTarget, Operations

#: How often progress is reported to the harness (it judges whether the client hung).
PROGRESS_INTERVAL_S = 0.1
#: How many lines of an event's evidence (e.g. a hung proc's stack) the report keeps.
EVIDENCE_LINES = 10

Invariant = Callable[[], object]


class Job:
    """What a chaos workload is given: the hosts to run on, and the run's controls."""

    def __init__(
        self,
        channel_socket: Any,
        hosts: HostMesh,
        agents: list[str],
        generation: int,
        params: dict[str, Any] | None = None,
    ) -> None:
        self.hosts = hosts
        #: The workload's parameters (``ChaosOptions.params``).
        self.params: dict[str, Any] = dict(params or {})
        #: 0 for the first client of the run; one more after each "kill_client" fault.
        self.generation = generation
        self._agents = agents
        self._targets: dict[str, ChaosTarget] = {}
        self._invariants: list[tuple[str, Invariant, bool]] = []
        self._finish = threading.Event()
        self._announced = False
        self._steps = 0
        self._reported_at = 0.0
        self._checked_at = 0.0
        self.invariant_interval_s = 1.0
        self._during_failures: list[dict[str, Any]] = []
        self._operations = Operations(self._targets, hosts, agents, self._finish)
        self._channel = Channel(channel_socket, self._on_message)
        self._remove_listener = add_event_listener(self._on_event)
        self._channel.send({"type": "hello", "generation": generation})

    # -- what the workload calls ----------------------------------------------------------------

    def target(
        self, actors: ActorMesh[Any], *, heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    ) -> ActorMesh[Any]:
        """Let chaos aim at the ranks of `actors` (give the heartbeat timeout of its procs if
        not the default, so that pauses are judged right). Returns `actors`."""
        if self._announced:
            raise RuntimeError("register every target before the first job.running()")
        if actors.name in self._targets:
            raise ValueError(f"mesh {actors.name!r} is already a chaos target")
        self._targets[actors.name] = ChaosTarget(actors, heartbeat_timeout_s)
        return actors

    def invariant(self, name: str, check: Invariant, *, during: bool = False) -> None:
        """Check `check()` after the final heal (and, with `during`, about once a second while
        the workload runs, from inside ``job.running()``). A falsy return or an exception
        means the invariant did not hold; a returned string says why."""
        self._invariants.append((name, check, during))

    def running(self) -> bool:
        """True until the harness ends the run; call once per step of the workload loop."""
        if not self._announced:
            self._announce()
        self._steps += 1
        now = time.monotonic()
        if now - self._reported_at >= PROGRESS_INTERVAL_S:
            self._reported_at = now
            self._note({"type": "progress", "steps": self._steps, "at": now})
        if now - self._checked_at >= self.invariant_interval_s:
            self._checked_at = now
            self._check_during()
        return not self._finish.is_set()

    def sleep(self, seconds: float) -> None:
        """Sleep, but wake at once when the run ends."""
        self._finish.wait(seconds)

    @property
    def steps(self) -> int:
        return self._steps

    def record(self, key: str, value: Any) -> None:
        """Put `value` (JSON) in the report's ``workload_stats[key]`` (the last one counts)."""
        self._note({"type": "record", "key": key, "value": value})

    # -- the end ----------------------------------------------------------------------------------

    def complete(self) -> None:
        """The workload returned: check the invariants and tell the harness."""
        results = [*self._during_failures]
        for name, check, _ in self._invariants:
            results.append(_check(name, check))
        self._note({"type": "invariants", "results": results, "steps": self._steps})
        self._note({"type": "done"})
        self._remove_listener()

    def crashed(self, error: BaseException) -> None:
        self._note({"type": "crashed", "error": "".join(traceback.format_exception(error))})
        self._remove_listener()

    # -- talking to the harness -------------------------------------------------------------------

    def _announce(self) -> None:
        if not self._targets:
            raise RuntimeError("a chaos workload must register a target: job.target(actors)")
        self._announced = True
        meshes = {name: len(t.actors) for name, t in self._targets.items()}
        timeouts = {name: t.heartbeat_timeout_s for name, t in self._targets.items()}
        self._note(
            {
                "type": "ready",
                "meshes": meshes,
                "heartbeat_timeouts": timeouts,
                "hosts": len(self._agents),
            }
        )

    def _note(self, message: Message) -> None:
        if not self._channel.closed:
            try:
                self._channel.send(message)
            except ConnectionError:
                pass

    def _on_event(self, event: SupervisionEvent) -> None:
        mesh, rank, host = self._locate(event)
        self._note(
            {
                "type": "event",
                "at": time.monotonic(),
                "kind": event.kind,
                "mesh": mesh,
                "rank": rank,
                "host": host,
                "pid": event.pid,
                "message": str(event),
                "evidence": "\n".join(event.root_cause().evidence(EVIDENCE_LINES)),
            }
        )

    def _locate(self, event: SupervisionEvent) -> tuple[str | None, int | None, int | None]:
        """The target mesh, flat rank and host index that `event` concerns, where known."""
        for name, target in self._targets.items():
            for where in placement(target.actors):
                if where.proc_id == event.proc_id:
                    return name, where.rank, self._operations.host_of(where.agent)
        return event.mesh_name, None, None

    def _on_message(self, message: Message) -> None:
        if message["type"] == "closed":
            self._finish.set()  # the harness is gone: end the workload
        elif message["type"] == "request":
            threading.Thread(
                target=self._operations.serve, args=(self._channel, message), daemon=True
            ).start()

    def _check_during(self) -> None:
        broken = {result["name"] for result in self._during_failures}
        for name, check, during in self._invariants:
            if during and name not in broken:  # the first breach of each is what matters
                result = _check(name, check)
                if not result["held"]:
                    result["detail"] = f"during the run: {result['detail']}"
                    self._during_failures.append(result)


def _check(name: str, check: Invariant) -> dict[str, Any]:
    try:
        outcome = check()
    except Exception as exc:
        return {"name": name, "held": False, "detail": f"raised {type(exc).__name__}: {exc}"}
    if isinstance(outcome, str):
        return {"name": name, "held": False, "detail": outcome}
    held = outcome is None or bool(outcome)
    return {"name": name, "held": held, "detail": "" if held else f"returned {outcome!r}"}
