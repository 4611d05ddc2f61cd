"""`AgentQueries`: requests to host agents that each answer once, matched by request id (the
registration, listing, adoption and stopping of detached meshes, workspace syncs). Every wait
ends: an agent that does not answer in time is named, never waited for forever.

Their message modules load with the first request (the API that sends one has loaded them
already), not with every process's runtime: most procs never ask an agent anything."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from mesh._engine.future import Future, LoopPump
from transport import Envelope, Payload

Handlers = dict[type, Callable[[Envelope], None]]


def answer_types() -> tuple[type, ...]:
    """The answers these queries get, each carrying the `request_id` it answers."""
    from mesh._engine.detached_messages import (
        DetachedListing,
        DetachedStopped,
        MeshClaim,
        Registered,
    )
    from mesh._engine.workspace_messages import WORKSPACE_ANSWERS

    return (Registered, DetachedListing, MeshClaim, DetachedStopped, *WORKSPACE_ANSWERS)


class QueryHost(LoopPump, Protocol):
    """What queries need of the runtime: sending (and its loop, to wait on it)."""

    def send_message(self, address: str, header: Any, payload: Payload | None = None) -> None: ...

    def address_for(self, peer: str | None, home: Any = None) -> str:
        """This process's address to hand to the process at `peer` (`Runtime.address_for`)."""
        ...


class AgentQueries:
    """Requests in flight to host agents, by request id."""

    def __init__(self, runtime: QueryHost, handlers: Handlers) -> None:
        self._runtime = runtime
        self._handlers = handlers  # the runtime's table: the answers' entries come with a request
        self._expecting = False  # whether they are in it
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, Future[Any]] = {}

    def ask(
        self, agents: list[str], request: Callable[[int, str], Any], timeout_s: float
    ) -> dict[str, Any]:
        """Send `request(request_id, reply_to)` to each agent; their answers by agent. TimeoutError
        naming those that did not answer within `timeout_s`."""
        futures = {agent: self.send(agent, request) for agent in agents}
        return self.collect(futures, timeout_s)

    def collect(
        self,
        futures: Mapping[str, tuple[int, Future[Any]]],
        timeout_s: float,
        *,
        partial: bool = False,
    ) -> dict[str, Any]:
        """The answers of `futures` (by agent), waiting at most `timeout_s` in all; with
        `partial`, those that came (TimeoutError only if none did)."""
        deadline = time.monotonic() + timeout_s
        answers, silent = {}, []
        for agent, (request_id, future) in futures.items():
            try:
                answers[agent] = future.get(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                silent.append(agent)
                with self._lock:
                    self._waiting.pop(request_id, None)
        if silent and (not partial or not answers):
            raise TimeoutError(
                f"host agents {silent} did not answer within {timeout_s:g} s: they are not "
                "running, not reachable from here, or too old to know detached meshes"
            )
        return answers

    def send(self, agent: str, request: Callable[[int, str], Any]) -> tuple[int, Future[Any]]:
        """Send `request(request_id, reply_to)` to `agent` (`reply_to`: this process's address
        for that agent); the id and the future of its answer."""
        request_id = next(self._ids)
        future: Future[Any] = Future(self._runtime, f"the answer of host agent {agent}")
        with self._lock:
            if not self._expecting:  # the first request
                self._handlers.update(dict.fromkeys(answer_types(), self._on_answer))
                self._expecting = True
            self._waiting[request_id] = future
        self._runtime.send_message(agent, request(request_id, self._runtime.address_for(agent)))
        return request_id, future

    def _on_answer(self, envelope: Envelope) -> None:
        with self._lock:
            future = self._waiting.pop(envelope.header.request_id, None)
        if future is not None:
            future.set_result(envelope.header)
