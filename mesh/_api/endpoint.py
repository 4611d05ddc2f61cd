"""Adverbs: the ways to call an endpoint on a mesh (call, call_one, choose, stream, broadcast).

`EndpointRef[P, R]` is typed by the endpoint's parameters `P` and result `R`. Plain mypy sees
``actors.step`` as ``EndpointRef[..., Any]``; the `mesh.mypy` plugin gives it the endpoint's own
types (see that module for how to enable it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypeVar

from mesh._engine.calls import ChosenSink, GatherSink, OneSink, ResultSink, StreamSink, pick_one
from mesh._engine.future import Future
from mesh._shape import Extent
from mesh._values import ValueMesh

if TYPE_CHECKING:
    from mesh._engine.replies import ReplyInbox
    from mesh._engine.runtime import Runtime
    from supervision import SupervisionEvent

P = ParamSpec("P")
R = TypeVar("R")


class CallableMesh(Protocol):
    """What an `EndpointRef` needs of the actor mesh it calls (`ActorMesh` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def extent(self) -> Extent: ...

    @property
    def sizes(self) -> dict[str, int]: ...

    @property
    def _runtime(self) -> Runtime: ...

    def __len__(self) -> int: ...

    def _covers(self, event: SupervisionEvent) -> bool: ...

    def _invoke(
        self,
        endpoint: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        indices: Iterable[int],
        sink: ResultSink | None,
        home: ReplyInbox | None,
    ) -> None: ...

    def _invoke_one(
        self,
        endpoint: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        index: int,
        sink: OneSink,
        home: ReplyInbox | None,
    ) -> None: ...


class EndpointRef(Generic[P, R]):
    """One endpoint of one actor mesh (or slice), ready to be called."""

    __slots__ = ("_mesh", "name")

    def __init__(self, mesh: CallableMesh, name: str) -> None:
        self._mesh = mesh
        self.name = name

    def call(self, *args: P.args, **kwargs: P.kwargs) -> Future[ValueMesh[R]]:
        """Call every actor; the future holds a ValueMesh once all have answered."""
        mesh = self._mesh
        home = mesh._runtime.replies.for_current_thread()
        future: Future[ValueMesh[R]] = Future(mesh._runtime, self._describe("call"), home, mesh)
        mesh._invoke(
            self.name, args, kwargs, range(len(mesh)), GatherSink(future, mesh.extent), home
        )
        return future

    def call_one(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call the one actor of a mesh of size 1 (else ValueError, at once)."""
        mesh = self._mesh
        if len(mesh) != 1:
            raise ValueError(
                f"call_one() needs a mesh of exactly one actor, but mesh "
                f"{mesh.name!r} has {len(mesh)} ({dict(mesh.sizes)}); slice it "
                "down to one actor first or use call()."
            )
        home = mesh._runtime.replies.for_current_thread()
        future = OneSink(mesh._runtime, self, home, mesh)
        mesh._invoke_one(self.name, args, kwargs, 0, future, home)
        return future

    def choose(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call one actor picked at random."""
        mesh = self._mesh
        home = mesh._runtime.replies.for_current_thread()
        future = ChosenSink(mesh._runtime, self, home, mesh)
        mesh._invoke_one(self.name, args, kwargs, pick_one(len(mesh)), future, home)
        return future

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> Iterator[Future[R]]:
        """Call every actor; yields one future per answer, in arrival order."""
        mesh = self._mesh
        home = mesh._runtime.replies.for_current_thread()
        futures: list[Future[R]] = [
            Future(mesh._runtime, self._describe("stream"), home, mesh) for _ in range(len(mesh))
        ]
        sink = StreamSink(futures)
        mesh._invoke(self.name, args, kwargs, range(len(mesh)), sink, home)
        return iter(futures)

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Send to every actor without waiting; an exception fails the actor (no one to tell)."""
        mesh = self._mesh
        mesh._invoke(self.name, args, kwargs, range(len(mesh)), None, None)

    def _describe(self, adverb: str) -> str:
        return f"{adverb}() of {self._mesh.name}.{self.name}"

    def __repr__(self) -> str:
        return f"<endpoint {self._mesh.name}.{self.name}>"
