"""`LoneCalls`: a call that arrives alone for an idle actor, run by the receiver at once.

Most calls to a proc come one at a time (a caller waits for each answer), each alone in its
frame, to an actor with nothing queued or running. For those, the general path (decode an
envelope, classify it as `Work`, post it in the mailbox, hand the first sync work back to the
receiver, drain the mailbox, prepare the endpoint's function) does the same work each time
for the same caller, actor and endpoint. Here the header of such a call, but for its call id,
is a key (`transport.KeyedInbox`) to a `Route` learnt from the first call that took the
general path: the actor, its endpoint and the call's context. A call whose key is known comes
as its route, id and body, alone or from a batch. If nothing waits for the event loop and
its actor is idle, the receiver runs it itself (`Lanes.claim_idle`, `Lanes.run_alone`: what
arrives meanwhile waits in the mailbox and runs after it, in order); if the actor is busy
(pipelined calls), it is queued as "lone" work carrying its route; else it takes the general
path as an envelope. The call itself runs as `ActorHost` runs a sync call: refused when the
actor is not running, an injected failure, the call watch, the actor's context, the reply or
the error.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

from mesh._context import Context, enter_context, exit_context
from mesh._engine.builtins import InjectedFailures
from mesh._engine.hosted_actor import HostedActor
from mesh._engine.lanes import Lanes
from mesh._engine.messages import CallActor
from mesh._engine.replying import Replier
from mesh._engine.work import Work, new_work
from transport import (
    Envelope,
    Keyed,
    Payload,
    PreparedHeader,
    envelope_of,
    keyed_shape,
    loads,
    payload_of,
)

#: The most routes kept (one per caller, actor, endpoint and point); then they start afresh.
_MOST_ROUTES = 1024
#: A call's fields after its id, in the order of its header.
_REST = operator.attrgetter("reply_to", "actor_id", "endpoint", "labels", "sizes", "rank")

Task = tuple[Callable[..., object], tuple[Any, ...]]


class Route:
    """What the calls with one header (but for their ids) need: the actor, the fields after
    the id, the endpoint's function and the context of the call's point."""

    __slots__ = ("actor", "actor_id", "context", "function", "head", "rest")

    def __init__(
        self,
        actor: HostedActor,
        header: CallActor,
        function: Callable[..., Any],
        head: PreparedHeader,
    ) -> None:
        self.actor = actor
        self.actor_id = header.actor_id
        self.rest: tuple[Any, ...] = _REST(header)
        self.function = function
        self.context: Context = actor.call_context(header)
        self.head = head  # the `Reply` header of the call's rank


class LoneCalls:
    """The routes of this proc's calls, and running a lone call on the receiving thread."""

    def __init__(
        self,
        actors: Mapping[str, HostedActor],
        lanes: Lanes,
        replier: Replier,
        injected: InjectedFailures,
        run_sync: Callable[[HostedActor, Work[CallActor]], None],
        raised: Callable[[HostedActor, CallActor, BaseException, bool | None], None],
    ) -> None:
        self._actors = actors
        self._lanes = lanes
        self._replier = replier
        self._injected = injected
        self._run_sync = run_sync  # `ActorHost._call_sync`: the general way, for the rare cases
        self._raised = raised  # `ActorHost._endpoint_raised`
        self.shape = shape = keyed_shape(CallActor)
        self._build = shape.layout.build
        #: Routes by key (`KeyedShape.key`): read by the receiving thread, learnt on any.
        self.routes: dict[bytes, Route] = {}
        #: The key of each header's fields after the id (None: it has none), as `learn` made
        #: it: a header seen before is not encoded again (a call on the general path: a large
        #: shared payload, or a batch, comes that way each time).
        self._keys: dict[tuple[Any, ...], bytes | None] = {}
        #: How many calls the receiver ran this way (`mesh.testing.receiver_lone_calls`).
        self.taken = 0

    def learn(self, actor: HostedActor, header: CallActor) -> None:
        """Keep the route of `header`'s calls to `actor` (a call that took the general path),
        if they may take this one: a sync endpoint, neither concurrent nor with a port."""
        found = actor.endpoints.get(header.endpoint)
        if found is None or found.is_async or found.concurrent or found.explicit_response_port:
            return
        key = self._key(_REST(header))
        routes = self.routes
        if key is None or (key in routes and routes[key].actor is actor):
            return
        head = self._replier.reply_head(header.rank)
        if head is None:
            return
        if len(routes) >= _MOST_ROUTES:
            routes.clear()
        routes[key] = Route(actor, header, found.function, head)

    def _key(self, rest: tuple[Any, ...]) -> bytes | None:
        """The key of the headers whose fields after the id are `rest`, encoded once."""
        keys = self._keys
        try:
            return keys[rest]
        except KeyError:  # a header not seen before (or since the keys started afresh)
            pass
        if len(keys) >= _MOST_ROUTES:
            keys.clear()
        key = keys[rest] = self.shape.key(rest)
        return key

    def take(self, lone: Keyed, handing: bool) -> Task | Envelope | None:
        """The receiver's task for a lone call (its actor is then busy with it); None when
        the call was queued behind what its actor runs; or the call as an envelope for the
        general path: its actor is not the one here now, messages wait for the event loop
        (`handing`), or the call has no arguments."""
        route, call_id, body = lone
        header = self._build((call_id, *route.rest))
        actor: HostedActor = route.actor
        if handing or not body or self._actors.get(route.actor_id) is not actor:
            return envelope_of(header, body)
        if self._lanes.claim_idle(actor):
            self.taken += 1
            return self._lanes.run_alone, (actor, self._call, route, header, body)
        self._lanes.post(actor, new_work(("lone", header, payload_of(body), None, route)))
        return None

    def take_shared(self, header: CallActor, payload: Payload) -> bool:
        """Whether a call whose payload came shared (an arena's, a memory file's) was started
        on the short path: its route is known and its actor here and idle (else it takes the
        general path, as a lone call would)."""
        key = self._key(_REST(header))
        route = self.routes.get(key) if key is not None else None
        if route is None or self._actors.get(route.actor_id) is not route.actor:
            return False
        if not self._lanes.start_alone(route.actor, self._call, route, header, None, payload):
            return False
        self.taken += 1
        return True

    def run_queued(self, actor: HostedActor, work: Work[CallActor]) -> None:
        """Worker thread: a "lone" call that waited in the mailbox (`Lanes`' runner)."""
        assert work.payload is not None
        self._call(work.route, work.header, work.payload.body)  # type: ignore[arg-type]

    def _call(
        self,
        route: Route,
        header: CallActor,
        body: memoryview | bytes | None,
        shared: Payload | None = None,
    ) -> None:
        """Run the call as `ActorHost._call_sync` does, with what its route holds; its
        arguments are `body`, or the `shared` payload's (None: `body` is)."""
        actor = route.actor
        if actor.state != "running" or self._injected.pending:
            payload = shared if body is None else payload_of(body)
            self._run_sync(actor, new_work(("call", header, payload, None, None)))
            return
        try:
            args, kwargs = loads(body) if body is not None else shared.load()  # type: ignore[union-attr]
            method = route.function.__get__(actor.instance)
        except Exception as exc:
            self._raised(actor, header, exc, False)
            return
        actor.start_call(header, False)
        token = enter_context(route.context)
        try:
            result = method(*args, **kwargs)
        except BaseException as exc:
            if actor.end_call(header):
                self._raised(actor, header, exc, None)
            return
        finally:
            exit_context(token)
        if actor.end_call(header):
            self._replier.value_prepared(actor, header, route.head, result)


def take_shared(lone: LoneCalls, on_call: Callable[[Envelope], None], envelope: Envelope) -> None:
    """A call with a shared payload: on the short path if its actor is idle (see
    `LoneCalls.take_shared`), else as any call (`on_call`)."""
    payload = envelope.payload
    if payload is None or not lone.take_shared(envelope.header, payload):
        on_call(envelope)
