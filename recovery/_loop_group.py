"""`LoopGroup`: the controller side of replicas that run their own training loops.

It spawns one proc per replica on `hosts`, each running the user's loop function in a
`LoopRunner`, and answers their `Manager`s through a port: quorum, heals, commit decisions
(`Rounds`). A replica whose proc dies or hangs is re-spawned in place and its loop started
again; its manager heals from the live replicas as it asks for its first step. `run()` is
the controller's loop: it ends when every replica's loop has returned.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mesh import ActorMesh, Channel, Future, HostMesh, ProcMesh
from supervision import SupervisionError, SupervisionEvent
from transport import get_logger

from ._aborts import AbortNotices, QuorumKeys
from ._loop_protocol import AskQuorum, Envelope, Healed, Reply, parse_request
from ._loop_rounds import Rounds
from ._loop_runner import LoopRunner, LoopSpec
from ._members import PRELOAD, replica_env
from ._outcomes import Recovery, ReplicaGroupError, StepOutcome, short
from ._store_server import StoreServer

#: How long the controller's loop waits for a request before it looks at everything else.
POLL_S = 0.01


class LoopGroup:
    """`replicas` copies of `loop(*args, **kwargs)` on `hosts`, kept going through failures."""

    def __init__(
        self,
        hosts: HostMesh,
        loop: Callable[..., Any],
        *args: Any,
        replicas: int = 3,
        min_replicas: int = 2,
        name: str = "loop",
        step_timeout_s: float = 60.0,
        group_timeout_s: float = 3.0,
        wait_for_replicas_s: float = 120.0,
        store_host: str = "127.0.0.1",
        heartbeat_timeout_s: float | None = None,
        preload: Sequence[str] = PRELOAD,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        if not 1 <= min_replicas <= replicas:
            raise ValueError(
                f"min_replicas must be between 1 and replicas ({replicas}), not {min_replicas}"
            )
        if not callable(loop):
            raise TypeError(f"LoopGroup runs a function in each replica, not {loop!r}")
        self.name = name
        # rendezvous and abort notices; its connections fail as the procs do
        self._store = StoreServer(store_host, name, heartbeat_timeout_s)
        self._aborts = AbortNotices(self._store.addresses, group_timeout_s)
        self._keys = QuorumKeys(self._aborts)  # a quorum's keys go once no one needs them
        self._port, self._requests = Channel[Envelope].open(bound=4 * replicas + 16)
        self._spec = LoopSpec(
            loop,
            args,
            kwargs,
            replica=0,
            replicas=replicas,
            incarnation=0,
            port=self._port,
            store=self._store.addresses,
            group_timeout_s=group_timeout_s,
            request_timeout_s=wait_for_replicas_s + step_timeout_s,
        )
        self._rounds = Rounds(
            replicas,
            min_replicas,
            self._abort,
            self._runners,
            step_timeout_s,
            wait_for_replicas_s,
        )
        self.events: list[SupervisionEvent] = []
        self._results: dict[int, Any] = {}
        self._failures: queue.SimpleQueue[tuple[int, SupervisionEvent]] = queue.SimpleQueue()
        self._env = replica_env(preload, env)
        self._log = get_logger("recovery.loops", group=name)
        self._procs: list[ProcMesh] = []
        self._runners_: list[ActorMesh[LoopRunner]] = []
        self._runs: list[Future[Any] | None] = []
        self._respawns: dict[int, Future[None]] = {}
        self._next: Future[Envelope] | None = None
        for index in range(replicas):
            self._spawn(hosts, index, heartbeat_timeout_s)

    # -- the public face ---------------------------------------------------------------------

    @property
    def history(self) -> list[tuple[int, tuple[int, ...]]]:
        """(step, the replicas that trained it) of every committed step, in order."""
        return self._rounds.history

    @property
    def outcomes(self) -> list[StepOutcome]:
        """What became of each attempt at a step (committed, or discarded and why)."""
        return self._rounds.outcomes

    @property
    def recoveries(self) -> list[Recovery]:
        """Each failed replica's way back: failed, re-spawned, healed, committing again."""
        return self._rounds.recoveries

    def run(self, timeout_s: float = 3600.0) -> dict[int, Any]:
        """Answer the loops until each has returned; their return values by replica id."""
        deadline = time.monotonic() + timeout_s
        while len(self._results) < len(self._procs) or self._respawns:
            if time.monotonic() > deadline:
                raise ReplicaGroupError(
                    f"the loops did not end within {timeout_s:g} s: replicas "
                    f"{sorted(self._results)} returned, {self._rounds.committed_steps} steps "
                    "were committed"
                )
            self._serve_one(POLL_S)
            self._watch_runs()
            self._watch_respawns()
            self._rounds.tick()
            # a loop that missed the last group may still be leaving the one before it
            self._keys.formed(self._rounds.committed_quorums[0], ())
        return dict(sorted(self._results.items()))

    def close(self) -> None:
        """Stop every replica's proc (all at once)."""
        self._requests.close()
        stopping = []
        for procs in self._procs:
            try:
                stopping.append(procs.stop(grace_s=1.0))
            except Exception:
                pass
        for stop in stopping:
            try:
                stop.get(timeout=10.0)
            except Exception:
                pass
        self._aborts.close()
        self._store.close()

    def __enter__(self) -> LoopGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- replicas ----------------------------------------------------------------------------

    def _spawn(self, hosts: HostMesh, index: int, hb_timeout: float | None) -> None:
        where = hosts
        if "hosts" in hosts.extent.labels:
            count = hosts.extent.sizes[hosts.extent.labels.index("hosts")]
            where = hosts.slice(hosts=index % count)
        procs = where.spawn_procs(
            per_host={"gpus": 1},
            name=f"{self.name}{index}-procs",
            env=self._env or None,
            heartbeat_timeout_s=hb_timeout,
        )
        runner = procs.spawn(f"{self.name}{index}", LoopRunner)
        self._procs.append(procs)
        self._runners_.append(runner)
        self._runs.append(None)
        procs.on_failure(lambda event: self._on_event(index, event))
        runner.on_failure(lambda event: self._on_event(index, event))
        self._start_loop(index, 0)

    def _start_loop(self, index: int, incarnation: int) -> None:
        spec = dataclasses.replace(self._spec, replica=index, incarnation=incarnation)
        self._runs[index] = self._runners_[index].run.call_one(spec)

    def _on_event(self, index: int, event: SupervisionEvent) -> bool:
        """A failure of replica `index` from the supervision tree (event loop thread)."""
        self._failures.put((index, event))
        return True  # handled: the controller's loop re-spawns it

    def _watch_runs(self) -> None:
        while not self._failures.empty():
            index, event = self._failures.get()
            if not event.is_notice:
                self.events.append(event)
        for index, run in enumerate(self._runs):
            if run is None or not run.done():
                continue
            self._runs[index] = None
            error = run.exception()
            if error is None:
                self._results[index] = run.get(timeout=0)
                self._rounds.finished(index)
            elif isinstance(error, SupervisionError):
                self._failed(index, short(error))
            else:
                raise ReplicaGroupError(
                    f"replica {index}'s training loop raised {short(error)}"
                ) from error

    def _failed(self, index: int, why: str) -> None:
        self._log.warning("loop_failed", replica=index, reason=why)
        self._results.pop(index, None)
        self._rounds.failed(index, why)
        self._respawns[index] = self._procs[index].respawn()

    def _watch_respawns(self) -> None:
        for index, respawn in list(self._respawns.items()):
            if not respawn.done():
                continue
            del self._respawns[index]
            if respawn.exception() is not None:  # try again
                self._log.warning("loop_respawn_failed", replica=index)
                self._respawns[index] = self._procs[index].respawn()
                continue
            self._start_loop(index, self._rounds.respawned(index))

    # -- requests ----------------------------------------------------------------------------

    def _serve_one(self, timeout_s: float) -> None:
        if self._next is None:
            self._next = self._requests.recv()
        try:
            message = self._next.get(timeout=timeout_s)
        except TimeoutError:
            return
        except SupervisionError:  # every holder of the port is gone for now (re-spawning)
            self._next = None
            time.sleep(timeout_s)
            return
        self._next = None
        try:
            envelope = parse_request(message, len(self._procs))
        except ValueError as exc:
            self._log.warning("loop_request_refused", reason=str(exc))
            return
        request, respond = envelope.request, self._responder(envelope)
        if isinstance(request, AskQuorum):
            self._rounds.ask(request, respond)
        elif isinstance(request, Healed):
            self._rounds.healed(request, respond)
        else:
            self._rounds.vote(request, respond)

    def _responder(self, envelope: Envelope) -> Callable[[Any], None]:
        def respond(answer: Any) -> None:
            try:
                envelope.reply.send(Reply(envelope.seq, answer))
            except SupervisionError:
                pass  # that loop's proc is gone: its failure is on its way

        return respond

    def _abort(self, quorum: int, why: str) -> None:
        self._aborts.abort(quorum, why)

    def _runners(self, indices: Sequence[int]) -> tuple[Any, ...]:
        return tuple(self._runners_[index] for index in indices)
