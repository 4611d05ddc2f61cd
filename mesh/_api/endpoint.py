"""Adverbs: the ways to call an endpoint on a mesh (call, call_one, choose, stream, broadcast)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from mesh._engine.calls import GatherSink, OneSink, StreamSink, pick_one
from mesh._engine.future import Future
from mesh._values import ValueMesh

if TYPE_CHECKING:
    from mesh._api.meshes import ActorMesh

R = TypeVar("R")


class EndpointRef(Generic[R]):
    """One endpoint of one actor mesh (or slice), ready to be called."""

    __slots__ = ("_mesh", "name")

    def __init__(self, mesh: ActorMesh[Any], name: str) -> None:
        self._mesh = mesh
        self.name = name

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh[R]]:
        """Call every actor; the future holds a ValueMesh once all have answered."""
        mesh = self._mesh
        home = mesh._runtime.replies.for_current_thread()
        future: Future[ValueMesh[R]] = Future(
            mesh._runtime, self._describe("call"), home, mesh._covers
        )
        mesh._invoke(
            self.name, args, kwargs, range(len(mesh)), GatherSink(future, mesh.extent), home
        )
        return future

    def call_one(self, *args: Any, **kwargs: Any) -> Future[R]:
        """Call the one actor of a mesh of size 1 (else ValueError, at once)."""
        mesh = self._mesh
        if len(mesh) != 1:
            raise ValueError(
                f"call_one() needs a mesh of exactly one actor, but mesh "
                f"{mesh.name!r} has {len(mesh)} ({dict(mesh.sizes)}); slice it "
                "down to one actor first or use call()."
            )
        home = mesh._runtime.replies.for_current_thread()
        future: Future[R] = Future(mesh._runtime, self._describe("call_one"), home, mesh._covers)
        mesh._invoke(self.name, args, kwargs, (0,), OneSink(future), home)
        return future

    def choose(self, *args: Any, **kwargs: Any) -> Future[R]:
        """Call one actor picked at random."""
        mesh = self._mesh
        home = mesh._runtime.replies.for_current_thread()
        future: Future[R] = Future(mesh._runtime, self._describe("choose"), home, mesh._covers)
        mesh._invoke(self.name, args, kwargs, (pick_one(len(mesh)),), OneSink(future), home)
        return future

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Future[R]]:
        """Call every actor; yields one future per answer, in arrival order."""
        mesh = self._mesh
        home = mesh._runtime.replies.for_current_thread()
        futures: list[Future[R]] = [
            Future(mesh._runtime, self._describe("stream"), home, mesh._covers)
            for _ in range(len(mesh))
        ]
        sink = StreamSink(futures)
        mesh._invoke(self.name, args, kwargs, range(len(mesh)), sink, home)
        return iter(futures)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Send to every actor without waiting; an exception fails the actor (no one to tell)."""
        mesh = self._mesh
        mesh._invoke(self.name, args, kwargs, range(len(mesh)), None, None)

    def _describe(self, adverb: str) -> str:
        return f"{adverb}() of {self._mesh.name}.{self.name}"

    def __repr__(self) -> str:
        return f"<endpoint {self._mesh.name}.{self.name}>"
