"""Replies still expected: one `PendingCall` per call id, feeding a result sink per adverb."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from mesh._engine.future import Future
from mesh._shape import Extent
from mesh._values import ValueMesh

if TYPE_CHECKING:
    from mesh._engine.peers import ActorMeshView, ProcPeer, Route
    from mesh._engine.replies import ReplyInbox


class ResultSink(Protocol):
    """Where the values (or errors) of one call's recipients go, indexed by rank in the call."""

    def deliver(self, rank: int, value: Any) -> None: ...
    def fail(self, rank: int, error: BaseException) -> None: ...


class PendingCall:
    """The recipients of one call to many that have not answered, keyed by the rank each
    was sent (`peers`); a call to one actor is its `OneSink` instead. `mesh` is the actor
    mesh called, so that a proc's failure is told about its actor. `sequence` is what
    `fanout.note_answer` needs: the route of each recipient's message and its number on it."""

    __slots__ = ("call_id", "home", "mesh", "peers", "sequence", "sink")

    def __init__(
        self,
        call_id: int,
        sink: ResultSink,
        peers: dict[int, ProcPeer],
        home: ReplyInbox | None,
        mesh: ActorMeshView | None = None,
    ) -> None:
        self.call_id = call_id
        self.sink = sink
        self.peers = peers
        self.home = home
        self.mesh = mesh
        self.sequence: dict[int, tuple[Route, int]] | None = None  # see fanout.route

    def recipient(self, rank: int) -> ProcPeer | None:
        """The proc of recipient `rank`, if that one has not answered."""
        return self.peers.get(rank)

    def waiting(self) -> list[tuple[int, ProcPeer]]:
        """The recipients that have not answered: (rank, proc) each."""
        return list(self.peers.items())


class OneSink(Future[Any]):
    """`call_one` and `choose`: the future of the single recipient is its own sink, and, sent
    by the short path (`CallTable.send_one`), its own entry in the call table: its recipient
    `peer` (None once it answered), `rank`, `mesh`, and the `route` its message took as the
    `sent`-th on it (`fanout.direct_route`). One object per call in flight, not three."""

    _ADVERB = "call_one"
    __slots__ = ("mesh", "peer", "rank", "route", "sent")
    peer: ProcPeer | None
    rank: int
    mesh: ActorMeshView | None
    route: Route
    sent: int

    #: `settle(value, error)`: the value, or the error (then `value` means nothing), with no
    #: call of its own (`CallTable.settle` of a call to one actor)
    settle = Future._finish

    def deliver(self, rank: int, value: Any) -> None:
        self._finish(value, None)

    def fail(self, rank: int, error: BaseException) -> None:
        self.set_exception(error)

    @property
    def home(self) -> ReplyInbox | None:
        """The reply inbox its answer comes to (None: the runtime's main inbox)."""
        return self._home  # type: ignore[return-value]

    def recipient(self, rank: int) -> ProcPeer | None:
        """Its recipient's proc, if that one has not answered and is recipient `rank`."""
        return self.peer if rank == self.rank else None

    def waiting(self) -> list[tuple[int, ProcPeer]]:
        """Its recipient, if that one has not answered: (rank, proc)."""
        return [] if self.peer is None else [(self.rank, self.peer)]


class ChosenSink(OneSink):
    """`choose`: a `OneSink` that says so in its messages."""

    _ADVERB = "choose"
    __slots__ = ()


class GatherSink:
    """`call`: a ValueMesh once every recipient answered; the first error fails it at once."""

    __slots__ = ("extent", "future", "missing", "values")

    def __init__(
        self, future: Future[ValueMesh[Any]], extent: Extent, expected: int | None = None
    ) -> None:
        self.future = future
        self.extent = extent
        self.values: list[Any] = [None] * extent.nelements
        self.missing = extent.nelements if expected is None else expected

    def deliver(self, rank: int, value: Any) -> None:
        self.values[rank] = value
        self.missing -= 1
        if self.missing == 0:
            self.future.set_result(ValueMesh(self.extent, self.values))

    def fail(self, rank: int, error: BaseException) -> None:
        self.future.set_exception(error)


class StreamSink:
    """`stream`: the k-th future holds the k-th answer to arrive."""

    __slots__ = ("arrived", "futures")

    def __init__(self, futures: list[Future[Any]]) -> None:
        self.futures = futures
        self.arrived = 0

    def deliver(self, rank: int, value: Any) -> None:
        self.futures[self.arrived].set_result(value)
        self.arrived += 1

    def fail(self, rank: int, error: BaseException) -> None:
        self.futures[self.arrived].set_exception(error)
        self.arrived += 1

    def __iter__(self) -> Iterator[Future[Any]]:
        return iter(self.futures)


def pick_one(count: int) -> int:
    """The recipient of `choose`: uniformly random."""
    return random.randrange(count)
