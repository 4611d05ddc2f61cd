"""`ActorMesh`: one actor per proc of a proc mesh; endpoints appear as attributes."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

from mesh._actor import reserve_endpoint_names, resolve_endpoint
from mesh._api.endpoint import EndpointRef
from mesh._api.mesh_base import MeshBase, Stoppable, adopt_peers, peer_infos, wait_ready
from mesh._context import actor_identity
from mesh._engine.builtins import INITIALIZED
from mesh._engine.calls import GatherSink, OneSink, ResultSink
from mesh._engine.future import Future, resolved
from mesh._engine.messages import CallActor, StopActor
from mesh._engine.ownership import FailureHandler
from mesh._engine.peers import ActorMeshView, ProcPeer
from mesh._engine.replies import ReplyInbox
from mesh._engine.runtime import Runtime
from mesh._engine.session import current_session
from mesh._shape import Extent, Region
from supervision import SupervisionError, SupervisionEvent
from transport import Addresses, PreparedHeader, dump_arguments, prepare_header

A = TypeVar("A")


#: What `ActorMesh._invoke_one` sends: made for the reply addresses, the peer's location,
#: whether peers get the nearest address, the extent and the rank in its stamp; the fields
#: of its `CallActor` after the call id; their header but for the call id.
PreparedCall = tuple[
    tuple[Addresses, str | None, bool, Extent, int], tuple[Any, ...], PreparedHeader | None
]
#: How many prepared calls an actor mesh keeps (by endpoint and reply inbox) before it
#: starts afresh: threads that made calls and ended leave theirs behind.
_MAX_PREPARED = 256


class ActorMeshState:
    """What all slices of one actor mesh share."""

    __slots__ = (
        "actor_class",
        "actor_id",
        "endpoints",
        "name",
        "peers",
        "prepared",
        "stopped",
        "view",
    )

    def __init__(
        self,
        name: str,
        actor_id: str,
        actor_class: type,
        peers: tuple[ProcPeer, ...],
        extent: Extent,
    ) -> None:
        self.name = name
        self.actor_id = actor_id
        self.actor_class = actor_class
        self.peers = peers
        self.stopped = False
        self.endpoints: dict[str, str] = {}
        #: by endpoint and reply addresses (their id): what a call to one actor sends
        self.prepared: dict[tuple[str, int], PreparedCall] = {}
        self.view = ActorMeshView(actor_id, name, extent, peers)


class ActorMesh(MeshBase, Stoppable, Generic[A]):
    """One actor per proc of a proc mesh. Endpoints appear as attributes: ``mesh.step.call()``."""

    def __init__(self, runtime: Runtime, state: ActorMeshState, region: Region) -> None:
        self._runtime = runtime
        self._state = state
        self._region = region

    @property
    def name(self) -> str:
        return self._state.name

    def _with_region(self, region: Region) -> ActorMesh[A]:
        return ActorMesh(self._runtime, self._state, region)

    def __getattr__(self, name: str) -> EndpointRef[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        state = self._state
        if name not in state.endpoints:
            state.endpoints[name] = resolve_endpoint(state.actor_class, name).name
        return EndpointRef(self, name)

    def _invoke(
        self,
        endpoint: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        indices: Iterable[int],
        sink: ResultSink | None,
        home: ReplyInbox | None,
    ) -> None:
        state = self._state
        if state.stopped:
            raise _stopped_error(state, endpoint)
        payload = dump_arguments(args, kwargs)
        runtime = self._runtime
        call_id = runtime.calls.new_call_id()
        messages = self._calls_to(endpoint, call_id, indices, sink is not None, home)
        runtime.calls.send_to_procs(messages, payload, sink, call_id, home, state.view)

    def _calls_to(
        self,
        endpoint: str,
        call_id: int,
        indices: Iterable[int],
        answered: bool,
        home: ReplyInbox | None,
    ) -> list[tuple[ProcPeer, Any]]:
        """The `CallActor` of call `call_id` for each recipient of `indices` (`answered`:
        with the address to answer, found once per host agent for its ready procs, which
        are all reached alike: all over ipc, or all over tcp)."""
        state, runtime = self._state, self._runtime
        labels, sizes, ranks = self.extent.labels, self.extent.sizes, self._region.ranks
        messages = []
        replies: dict[str | None, str] = {}  # by host agent
        for i in indices:
            peer = state.peers[ranks[i]]
            reply_to = None
            if answered:
                ready = peer.address is not None and peer.agent is not None
                reply_to = replies.get(peer.agent) if ready else None
                if reply_to is None:
                    reply_to = runtime.address_for(peer.location, home)
                    if ready:
                        replies[peer.agent] = reply_to
            call = CallActor(call_id, reply_to, state.actor_id, endpoint, labels, sizes, i)
            messages.append((peer, call))
        return messages

    def _invoke_one(
        self,
        endpoint: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        index: int,
        sink: OneSink,
        home: ReplyInbox | None,
    ) -> None:
        """`_invoke` for one recipient awaiting its answer (`call_one`, `choose`): the same
        message, sent by the short path."""
        state = self._state
        if state.stopped:
            raise _stopped_error(state, endpoint)
        runtime = self._runtime
        extent, ranks = self._region.extent, self._region.ranks
        peer = state.peers[ranks[index]]
        # the header but for its call id, kept per endpoint and reply inbox (threads taking
        # turns keep theirs): made again when what its reply address, slice or rank came
        # from changes
        mine = runtime.addresses if home is None else home.addresses
        stamp = (mine, peer.address or peer.agent, runtime.nearest_addresses, extent, index)
        kept = state.prepared.get((endpoint, id(mine)))  # `kept` holds `mine`: a unique id
        if kept is None or kept[0] != stamp:
            kept = _prepare_call(runtime, state, endpoint, home, stamp)
        runtime.calls.send_one(peer, kept[1], kept[2], (args, kwargs), sink, home, state.view)

    def on_failure(self, handler: FailureHandler) -> None:
        """Call `handler(event)` when an actor of this mesh fails; truthy return = handled."""
        self._runtime.ownership.set_handler(self._state.actor_id, handler)

    def _peers_in_region(self) -> list[ProcPeer]:
        """The procs that the actors of this (sliced) mesh run on, in rank order."""
        return [self._state.peers[rank] for rank in self._region.ranks]

    def _covers(self, event: SupervisionEvent) -> bool:
        """Whether `event` concerns an actor or proc that a call on this mesh reaches."""
        state = self._state
        return any(
            state.peers[r].proc_id == event.proc_id
            or event.actor_id == actor_identity(state.actor_id, r)
            for r in self._region.ranks
        )

    @property
    def initialized(self) -> Future[None]:
        """A future that resolves once every actor's constructor has returned, or raises a
        SupervisionError naming the first rank whose constructor failed. Answered as soon as
        the constructors end, not after the calls already queued behind them."""
        runtime, what = self._runtime, f"initialized of {self._state.name}"
        home = runtime.replies.for_current_thread()
        gathered: Future[Any] = Future(runtime, what, home, self)
        done: Future[None] = Future(runtime, what, home, self)
        gathered.add_done_callback(functools.partial(_settle_initialized, done))
        sink = GatherSink(gathered, self.extent)
        self._invoke(INITIALIZED, (), {}, range(len(self)), sink, home)
        return done

    def stop(self) -> Future[None]:
        """Stop these actors after the messages already sent to them; later calls fail."""
        state, runtime = self._state, self._runtime
        future: Future[Any] = Future(runtime, f"stop of {state.name}")
        call_id = runtime.calls.new_call_id()
        peers = [state.peers[base] for base in self._region.ranks]
        messages = [
            (peer, StopActor(call_id, runtime.address_for(peer.location), state.actor_id, rank))
            for rank, peer in enumerate(peers)
            if peer.alive
        ]
        if len(self._region) == len(state.peers):
            state.stopped = True
        if not messages:
            return resolved(None)
        sink = GatherSink(future, Extent(("actors",), (len(peers),)), expected=len(messages))
        runtime.calls.send_to_procs(messages, None, sink, call_id, mesh=state.view)
        done: Future[None] = Future(runtime, f"stop of {state.name}")
        future.add_done_callback(lambda f: done.set_result(None))
        return done

    def __reduce__(self) -> tuple[Any, ...]:
        state = self._state
        wait_ready(state.peers)
        return _rebuild_actor_mesh, (
            state.name,
            state.actor_id,
            state.actor_class,
            self._region,
            peer_infos(state.peers),
            state.view.extent,
        )

    def __repr__(self) -> str:
        return f"<ActorMesh {self.name!r} {self.sizes}>"


reserve_endpoint_names(ActorMesh)  # an endpoint named like a mesh attribute could not be called


def _prepare_call(
    runtime: Runtime,
    state: ActorMeshState,
    endpoint: str,
    home: ReplyInbox | None,
    stamp: tuple[Addresses, str | None, bool, Extent, int],
) -> PreparedCall:
    """The fields and header of a call to one actor (see `PreparedCall`), kept."""
    _, location, _, extent, index = stamp
    reply_to = runtime.address_for(location, home)
    fields = (reply_to, state.actor_id, endpoint, extent.labels, extent.sizes, index)
    if len(state.prepared) >= _MAX_PREPARED:
        state.prepared.clear()
    kept = state.prepared[(endpoint, id(stamp[0]))] = (
        stamp,
        fields,
        prepare_header(CallActor, fields),
    )
    return kept


def _stopped_error(state: ActorMeshState, endpoint: str) -> SupervisionError:
    """The error of a call made after the mesh was stopped."""
    return SupervisionError(
        SupervisionEvent("stopped", state.name, message="by its owner"),
        f"cannot call {state.name}.{endpoint}: ",
    )


def _settle_initialized(done: Future[None], calling: Future[Any]) -> None:
    error = calling.exception()
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


def _rebuild_actor_mesh(
    name: str,
    actor_id: str,
    actor_class: type,
    region: Region,
    infos: tuple[tuple[Any, ...], ...],
    extent: Extent,
) -> ActorMesh[Any]:
    runtime = current_session().runtime
    state = ActorMeshState(name, actor_id, actor_class, adopt_peers(runtime, infos), extent)
    return ActorMesh(runtime, state, region)
