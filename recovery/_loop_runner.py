"""`LoopRunner`: the actor that runs one replica's own training loop, inside its proc.

The `LoopGroup` calls `run` with the user's loop function; the loop's `Manager` finds the group
through `current_loop()` and registers with the runner, which then serves the heals of
replacements from the manager's committed state (`heal_layout`, `heal_chunks`, the endpoints a
heal calls on its donors). They are concurrent endpoints: they run while `run` does, and
serve only while the loop is at a step boundary, or finished, so the state does not move.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mesh import Actor, concurrent_endpoint
from transport import Addresses

from ._heal_donor import Stale
from ._heal_state import Chunk, Piece, StateLayout


@dataclass(frozen=True)
class LoopSpec:
    """What a replica's loop runs, and how it reaches its group."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    replica: int
    replicas: int
    incarnation: int  # 0 for the first run of this replica, then one more per re-spawn
    port: Any  # the group's Port, for requests
    store: Addresses  # the group's store, for process groups and abort notices
    group_timeout_s: float
    request_timeout_s: float


class Donor(Protocol):
    """What a runner needs of a manager to serve heals."""

    def donor_layout(self) -> StateLayout: ...

    def donor_chunks(self, step: int, pieces: Sequence[Piece]) -> list[Chunk] | Stale: ...


@dataclass
class LoopContext:
    """The running loop's spec, and where its manager registers (`attach`)."""

    spec: LoopSpec
    attach: Callable[[Donor], None] = field(repr=False)


_CURRENT: contextvars.ContextVar[LoopContext | None] = contextvars.ContextVar(
    "meshvisor_loop", default=None
)


def current_loop() -> LoopContext:
    """The loop this code runs in, as `LoopGroup` started it; RuntimeError outside one."""
    loop = _CURRENT.get()
    if loop is None:
        raise RuntimeError(
            "recovery.Manager() must be created inside a training loop started by "
            "recovery.LoopGroup (the function it runs in each replica), on the loop's thread"
        )
    return loop


class LoopRunner(Actor):
    """Runs a loop function (`run`) and serves heals from its manager."""

    def __init__(self) -> None:
        self._manager: Donor | None = None

    @concurrent_endpoint(call_limit_s=math.inf)  # a whole training run is one call
    def run(self, spec: LoopSpec) -> Any:
        token = _CURRENT.set(LoopContext(spec, self._attach))
        try:
            return spec.function(*spec.args, **spec.kwargs)
        finally:
            _CURRENT.reset(token)

    @concurrent_endpoint
    def heal_layout(self) -> StateLayout:
        return self._donor().donor_layout()

    @concurrent_endpoint
    def heal_chunks(self, step: int, pieces: Sequence[Piece]) -> list[Chunk] | Stale:
        return self._donor().donor_chunks(step, pieces)

    def _attach(self, manager: Donor) -> None:
        if self._manager is not None:
            raise RuntimeError("a training loop creates one recovery.Manager, not several")
        self._manager = manager

    def _donor(self) -> Donor:
        if self._manager is None:
            raise RuntimeError(
                "this replica's loop has no recovery.Manager yet: nothing to heal from"
            )
        return self._manager
