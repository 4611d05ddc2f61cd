"""`Accumulator`: one value from a mesh call, folded with a user reducer on the way back.

The ranks of one host (up to `fan_in` of them) form a group; one proc of the group calls its
members, folds their answers as they arrive and sends the client one partial result, which the
client folds in turn. So the client receives one value per group, and nobody holds every
answer at once. `combine` must therefore be associative and commutative, with `identity` as its
identity (sum, max, set union, merging counters...): answers are folded in arrival order, and
partial results are combined with each other. ``tree=False`` folds every answer at the client
instead, ``combine(accumulated, answer)`` in arrival order, which needs neither (Monarch's way).

Failures: the first one ends the reduction. A rank whose endpoint raised gives its ActorError,
a rank whose actor or proc died a SupervisionError naming that actor (as ``call`` does), and a
`combine` that raised a `ReducerError` naming the reducer and the ranks it was folding.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar

from mesh._api.actor_mesh import ActorMesh
from mesh._api.endpoint import EndpointRef
from mesh._engine.future import Future
from mesh._engine.messages import Relay
from mesh._shape import Extent
from transport import Payload

P = ParamSpec("P")
R = TypeVar("R")
A = TypeVar("A")

#: How many ranks of one host one proc reduces, by default.
DEFAULT_FAN_IN = 8


class ReducerError(Exception):
    """The reducer of an accumulate raised: the message names it, what it raised, and the
    ranks whose answers it was folding."""


class Accumulator(Generic[P, R, A]):
    """Reduces the answers of every actor of a mesh: ``Accumulator(mesh.ep, 0, add).accumulate()``.

    `fan_in` and `tree` are meshvisor's additions (see the module); without them it is Monarch's.
    """

    def __init__(
        self,
        endpoint: EndpointRef[P, R],
        identity: A,
        combine: Callable[[A, R], A],
        *,
        tree: bool = True,
        fan_in: int = DEFAULT_FAN_IN,
    ) -> None:
        if not isinstance(endpoint, EndpointRef) or not isinstance(endpoint._mesh, ActorMesh):
            raise TypeError(f"Accumulator needs an endpoint of an actor mesh, got {endpoint!r}")
        if not callable(combine):
            raise TypeError(
                f"Accumulator needs a callable combine(accumulated, value), got {combine!r}"
            )
        if type(fan_in) is not int or fan_in < 1:
            raise ValueError(f"Accumulator needs a fan_in of at least 1 (an int), got {fan_in!r}")
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine
        self._tree = tree
        self._fan_in = fan_in

    def accumulate(self, *args: P.args, **kwargs: P.kwargs) -> Future[A]:
        """Call the endpoint on every actor; the future holds the reduced value."""
        ref = self._endpoint
        mesh: ActorMesh[Any] = ref._mesh  # type: ignore[assignment]
        runtime = mesh._runtime
        home = runtime.replies.for_current_thread()
        future: Future[A] = Future(runtime, f"accumulate() of {mesh.name}.{ref.name}", home, mesh)
        if not self._tree:
            ranks = [[rank] for rank in range(len(mesh))]
            sink = FoldSink(future, self._identity, self._combine, mesh.extent, ranks)
            mesh._invoke(ref.name, args, kwargs, range(len(mesh)), sink, home)
            return future
        groups = _groups(mesh, self._fan_in)
        leaders = {group[0]: group for group in groups}
        sink = FoldSink(future, self._identity, self._combine, mesh.extent, leaders)
        relay_args = (mesh, leaders, ref.name, args, kwargs, self._identity, self._combine)
        payload = Payload.dump((_reduce_group, relay_args))
        call_id = runtime.calls.new_call_id()
        peers = mesh._peers_in_region()
        messages = [
            (
                peers[leader],
                Relay(call_id, runtime.address_for(peers[leader].location, home), leader),
            )
            for leader in leaders
        ]
        runtime.calls.send_to_procs(messages, payload, sink, call_id, home, mesh._state.view)
        return future


def _groups(mesh: ActorMesh[Any], fan_in: int) -> list[list[int]]:
    """The ranks (in the call) reduced together: by host, at most `fan_in` each."""
    by_host: dict[str | None, list[int]] = {}
    for rank, peer in enumerate(mesh._peers_in_region()):
        by_host.setdefault(peer.agent, []).append(rank)
    return [
        ranks[i : i + fan_in] for ranks in by_host.values() for i in range(0, len(ranks), fan_in)
    ]


def _reduce_group(
    leader: int,
    mesh: ActorMesh[Any],
    groups: dict[int, list[int]],
    endpoint: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    identity: Any,
    combine: Callable[[Any, Any], Any],
) -> Future[Any]:
    """In the leader's proc (a relay, on its event loop): call the group, fold its answers."""
    members = groups[leader]
    future: Future[Any] = Future(mesh._runtime, f"the reduction of ranks {members}")
    sink = FoldSink(future, identity, combine, mesh.extent, [[rank] for rank in members], members)
    mesh._invoke(endpoint, args, kwargs, members, sink, None)
    return future


class FoldSink:
    """A result sink that folds each answer into one value as it arrives (keeping none).
    `covers[key]` are the ranks the answer delivered as `key` stands for."""

    __slots__ = (
        "_combine",
        "_covers",
        "_done",
        "_extent",
        "_folded",
        "_future",
        "_lock",
        "_missing",
        "_value",
    )

    def __init__(
        self,
        future: Future[Any],
        identity: Any,
        combine: Callable[[Any, Any], Any],
        extent: Extent,
        covers: Sequence[list[int]] | dict[int, list[int]],
        keys: Sequence[int] | None = None,
    ) -> None:
        self._future = future
        self._value = identity
        self._combine = combine
        self._extent = extent
        if isinstance(covers, dict):
            self._covers = covers
        else:
            self._covers = dict(zip(keys if keys is not None else range(len(covers)), covers))
        self._missing = len(self._covers)
        self._folded: list[int] = []
        self._done = False
        self._lock = threading.Lock()
        if not self._missing:
            future.set_result(identity)

    def deliver(self, rank: int, value: Any) -> None:
        with self._lock:
            if self._done:
                return
            try:
                self._value = self._combine(self._value, value)
            except Exception as exc:
                self._done = True
                self._future.set_exception(self._reducer_error(rank, exc))
                return
            self._folded.extend(self._covers.get(rank, ()))
            self._missing -= 1
            if self._missing == 0:
                self._done = True
                self._future.set_result(self._value)

    def fail(self, rank: int, error: BaseException) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._future.set_exception(error)

    def _reducer_error(self, rank: int, exc: Exception) -> ReducerError:
        name = getattr(self._combine, "__qualname__", repr(self._combine))
        adding = [dict(self._extent.point(r)) for r in self._covers.get(rank, ())]
        folded = [dict(self._extent.point(r)) for r in sorted(self._folded)]
        error = ReducerError(
            f"the reducer {name} raised {type(exc).__name__}: {exc}, while folding the answer "
            f"of ranks {adding} into the value of ranks {folded or 'none (the identity)'}"
        )
        error.__cause__ = exc
        return error
