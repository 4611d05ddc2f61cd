"""`CallTable`: the calls this process made that still expect replies, and how they end.

A call sends one header per recipient proc (`send_to_procs`), or one per host agent for the
recipients of a host (`fanout`); each reply, failure or loss of a recipient's proc settles that
recipient's part, feeding the call's result sink.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from mesh._engine.call_errors import failure_error, gone_error, unreadable_error
from mesh._engine.calls import OneSink, PendingCall, ResultSink
from mesh._engine.fanout import direct_route, fan_out_frames, note_answer, route
from mesh._engine.fanout_messages import RelayedReplies, split_answers
from mesh._engine.fork import check_not_forked
from mesh._engine.messages import CallActor, Failure, Reply, ReplyLost, invalid_fields
from mesh._engine.notebook import note_call
from mesh._engine.peers import ActorMeshView, ProcPeer
from mesh._engine.replies import ReplyInbox
from supervision import ActorError, SupervisionEvent
from transport import (
    Envelope,
    Outbox,
    Payload,
    PreparedHeader,
    dump_arguments,
    encode,
    encode_fields,
    encode_prepared,
    encode_prepared_arguments,
    loads,
)

#: How one recipient of a call ended: its rank, its value, or the error it ended with.
Outcome = tuple[int, Any, BaseException | None]


class CallTable:
    """Pending calls by id. `lock` is the ownership lock: it also guards the peers' state."""

    def __init__(
        self, lock: threading.Lock, outbox: Outbox, pid: int, flush_soon: Callable[[], None]
    ) -> None:
        self._lock = lock
        self._outbox = outbox
        self._pid = pid
        self._flush_soon = flush_soon  # sends the batches started here soon (`send_soon`)
        self._calls: dict[int, PendingCall | OneSink] = {}
        self._ids = itertools.count(1)

    def new_call_id(self) -> int:
        return next(self._ids)

    def send_to_procs(
        self,
        messages: list[tuple[ProcPeer, Any]],
        payload: Payload | None,
        sink: ResultSink | None,
        call_id: int = 0,
        home: ReplyInbox | None = None,
        mesh: ActorMeshView | None = None,
    ) -> None:
        """Send one header per peer (same payload). With a `sink`, each header's `rank` keys
        its reply. `mesh`: the actor mesh addressed, named in the errors of gone procs."""
        check_not_forked(self._pid)
        if messages:
            note_call(messages[0][0].mesh_key)  # in a notebook: its lines go under this cell
        failed: list[tuple[int, BaseException]] = []
        busy: set[str] = set()
        with self._lock:
            pending = None
            if sink is not None:
                peers = {header.rank: peer for peer, header in messages}
                pending = self._calls[call_id] = PendingCall(call_id, sink, peers, home, mesh)
                if home is not None:  # they will connect to it, and drop that when it closes
                    home.called.update(peers.values())
            live = []
            for peer, header in messages:
                if not peer.alive:
                    assert peer.event is not None
                    failed.append((header.rank, gone_error(peer, peer.event, mesh)))
                    continue
                live.append((peer, header))
                if peer.calls:  # it has not answered earlier calls: it may wait
                    busy.add(peer.proc_id)
                if sink is not None:
                    peer.calls.add(call_id)
            routed = route(live, pending is not None, payload)
            if pending is not None:
                pending.sequence = routed.sequence
            batched = self._send_direct(routed.direct, payload, busy)
            for agent, group in routed.relayed.items():  # to busy procs: may wait, as above
                frames = fan_out_frames(group, payload)
                if busy and any(peer.proc_id in busy for peer, _ in group):
                    batched |= self._outbox.send_soon(agent, frames)
                else:
                    self._outbox.send(agent, frames)
        if batched:
            self._flush_soon()
        for index, error in failed:
            self.settle(call_id, index, error=error)

    def send_one(
        self,
        peer: ProcPeer,
        fields: tuple[Any, ...],
        prepared: PreparedHeader | None,
        arguments: tuple[tuple[Any, ...], dict[str, Any]],
        sink: OneSink,
        home: ReplyInbox | None,
        mesh: ActorMeshView,
    ) -> None:
        """Send a call to one actor with `arguments` (args, kwargs): `fields` are those of
        its `CallActor` after `call_id`, `prepared` its header but for `call_id` when it has
        a binary one (`prepare_header`). The common case (a ready proc reached straight, a few
        scalars for arguments) skips the machinery of calls to many and builds no header or
        payload object; anything else goes through `send_to_procs`. The caller found its
        reply inbox first (`ReplyRoutes.for_current_thread`), which checked that this is not
        a forked child."""
        note_call(peer.mesh_key)
        call_id, rank = next(self._ids), fields[-1]
        payload = None
        if (
            prepared is None
            or (frames := encode_prepared_arguments(prepared, call_id, *arguments)) is None
        ):
            payload = dump_arguments(*arguments)
            frames = _encoded(prepared, call_id, fields, payload)
        batched = False
        with self._lock:
            address = peer.address if peer.alive else None
            path = direct_route(peer, fields[1]) if address is not None else None
            if path is not None:  # the future is the call's entry (see `OneSink`)
                sink.peer, sink.rank, sink.mesh, sink.route, sink.sent = (
                    peer,
                    rank,
                    mesh,
                    path,
                    path.sent,
                )
                self._calls[call_id] = sink
                if home is not None:
                    home.called.add(peer)
                if peer.calls:  # it has not answered earlier calls: this one may wait
                    batched = self._outbox.send_soon(address, frames)  # type: ignore[arg-type]
                else:
                    self._outbox.send(address, frames)  # type: ignore[arg-type]
                peer.calls.add(call_id)
        if path is None:  # (a few scalars pickled again: cheaper than a payload every time)
            header = CallActor(call_id, *fields)
            payload = dump_arguments(*arguments) if payload is None else payload
            self.send_to_procs([(peer, header)], payload, sink, call_id, home, mesh)
        elif batched:
            self._flush_soon()

    def _send_direct(
        self, messages: list[tuple[ProcPeer, Any]], payload: Payload | None, busy: set[str]
    ) -> bool:
        """Send to each proc itself; to a `busy` one (still answering earlier calls) the
        message may wait to leave with others. Whether any waits (then flush soon)."""
        batched = False
        for peer, header in messages:
            frames = encode(header, payload)
            if peer.address is None:  # copy now: the caller may change its buffers
                peer.queued.append([frames[0], *(bytes(memoryview(b)) for b in frames[1:])])
            elif peer.proc_id in busy:
                batched |= self._outbox.send_soon(peer.address, frames)
            else:
                self._outbox.send(peer.address, frames)
        return batched

    def on_relayed(self, envelope: Envelope) -> None:
        """A host agent's batch of answers to one call (see `fanout`): each answer taken
        from its slice of the payload, and the call's table entry updated once for all."""
        header: RelayedReplies = envelope.header
        try:
            parts = split_answers(envelope)
        except ValueError as exc:  # the call must end: its ranks in this batch fail
            if invalid_fields(header) is None:
                for rank in header.ranks:
                    self.settle(header.call_id, rank, error=ActorError(str(exc)))
            return
        call_id = header.call_id
        outcomes: list[Outcome] = []
        for rank, kind, body, buffers in parts:
            if kind:
                outcomes.append((rank, None, failure_error(call_id, kind, Payload(body, buffers))))
                continue
            try:
                outcomes.append((rank, loads(body, buffers), None))
            except Exception as exc:
                outcomes.append((rank, None, unreadable_error(call_id, exc)))
        self._settle_all(call_id, outcomes)

    def on_reply(self, envelope: Envelope) -> None:
        header: Reply = envelope.header
        payload: Payload = envelope.payload  # type: ignore[assignment]
        try:  # `on_lone_reply`, inlined: once per reply of a batch
            value = loads(payload.body, payload.buffers)  # `Payload.load`, one call less
        except Exception as exc:
            self.settle(header.call_id, header.rank, error=unreadable_error(header.call_id, exc))
            return
        self.settle(header.call_id, header.rank, value)

    def on_lone_reply(self, call_id: int, rank: int, body: bytes | memoryview) -> None:
        """Recipient `rank` of call `call_id` answered with the pickled value `body`."""
        try:
            value = loads(body)
        except Exception as exc:
            self.settle(call_id, rank, error=unreadable_error(call_id, exc))
            return
        self.settle(call_id, rank, value)

    def on_failure(self, envelope: Envelope) -> None:
        header: Failure = envelope.header
        error = failure_error(header.call_id, header.kind, envelope.payload)
        self.settle(header.call_id, header.rank, error=error)

    def fail_lost_reply(self, lost: ReplyLost) -> bool:
        """A proc could not send its answer to a call made here (`lost`): that recipient's
        part fails with an "unreachable" error naming the proc, the endpoint and why.
        False if no such call waits on that proc here."""
        with self._lock:
            pending = self._calls.get(lost.call_id)
            peer = None if pending is None else pending.recipient(lost.rank)
        if pending is None or peer is None or peer.proc_id != lost.proc_id:
            return False
        why = (
            f"its answer to call {lost.call_id} of endpoint {lost.endpoint!r} could not be "
            f"sent from proc {lost.proc_id} to {lost.reply_to}: {lost.reason}"
        )
        error = gone_error(peer, peer.make_event("unreachable", why), pending.mesh)
        self.settle(lost.call_id, lost.rank, error=error)
        if pending.home is not None:
            pending.home.wake()
        return True

    def fail_every_lost_reply(self, lost: ReplyLost, home: ReplyInbox | None) -> int:
        """Proc `lost.proc_id` could send no answer to `home` (`lost`, for every call): each
        call made there that waits on that proc fails as in `fail_lost_reply`. How many."""
        with self._lock:
            found = [
                (call_id, pending, rank, peer)
                for call_id, pending in self._calls.items()
                if pending.home is home
                for rank, peer in pending.waiting()
                if peer.proc_id == lost.proc_id
            ]
        why = (
            f"its answers to calls from {lost.reply_to} could not be sent from proc "
            f"{lost.proc_id}: {lost.reason}"
        )
        for call_id, pending, rank, peer in found:
            error = gone_error(peer, peer.make_event("unreachable", why), pending.mesh)
            self.settle(call_id, rank, error=error)
            if pending.home is not None:
                pending.home.wake()
        return len(found)

    def inboxes_awaiting_replies(self) -> set[int]:
        """The ids of the reply inboxes that pending calls will be answered at."""
        with self._lock:
            return {id(call.home) for call in self._calls.values() if call.home is not None}

    def settle(
        self, call_id: int, rank: int, value: Any = None, error: BaseException | None = None
    ) -> None:
        """Recipient `rank` of call `call_id` answered `value` (or failed with `error`)."""
        pending = self._calls.get(call_id)  # (atomic: whether it is still due is seen below)
        if isinstance(pending, OneSink):  # a call to one actor (`send_one`)
            with self._lock:
                peer = pending.peer
                if peer is None or rank != pending.rank:  # answered (or failed) already
                    return
                pending.peer = None
                path = pending.route  # `fanout.note_answer`, inlined
                if pending.sent > path.seen:
                    path.seen = pending.sent
                peer.calls.discard(call_id)
                del self._calls[call_id]
            pending.settle(value, error)
            return
        if pending is None:
            return
        with self._lock:
            peer = pending.peers.pop(rank, None)
            if peer is None:
                return
            note_answer(pending, rank)
            if not pending.peers:  # none left
                peer.calls.discard(call_id)
                del self._calls[call_id]
            elif peer not in pending.peers.values():  # (identity, compared in C)
                peer.calls.discard(call_id)
        if error is None:
            pending.sink.deliver(rank, value)
        else:
            pending.sink.fail(rank, error)

    def _settle_all(self, call_id: int, outcomes: list[Outcome]) -> None:
        """`settle` for several recipients of call `call_id` (rank, value, error each), in
        their order: the lock taken once, each rank's bookkeeping done in one loop."""
        with self._lock:
            pending = self._calls.get(call_id)
            if pending is None:
                return
            many = None if isinstance(pending, OneSink) else pending  # (one: never relayed)
            if many is not None:
                peers, fed, done = many.peers, [], []
                for outcome in outcomes:
                    peer = peers.pop(outcome[0], None)
                    if peer is not None:
                        note_answer(many, outcome[0])
                        fed.append(outcome)
                        done.append(peer)
                if not peers:
                    del self._calls[call_id]
                left = set(peers.values())
                for peer in done:
                    if peer not in left:
                        peer.calls.discard(call_id)
        if many is None:
            for rank, value, error in outcomes:
                self.settle(call_id, rank, value=value, error=error)
            return
        sink = many.sink
        for rank, value, error in fed:
            if error is None:
                sink.deliver(rank, value)
            else:
                sink.fail(rank, error)

    def take_waiting_on(self, peer: ProcPeer) -> list[tuple[int, PendingCall | OneSink]]:
        """The calls waiting on `peer`, which no longer waits for them (lock held)."""
        calls = self._calls
        waiting = [(call_id, calls[call_id]) for call_id in peer.calls if call_id in calls]
        peer.calls = set()
        return waiting

    def fail_waiting(
        self,
        peer: ProcPeer,
        event: SupervisionEvent,
        waiting: list[tuple[int, PendingCall | OneSink]],
    ) -> None:
        """`peer`'s proc is gone (`event`): the calls that waited on it fail."""
        for call_id, pending in waiting:
            for rank, target in pending.waiting():
                if target is peer:
                    self.settle(call_id, rank, error=gone_error(peer, event, pending.mesh))
            if pending.home is not None:
                pending.home.wake()


def _encoded(
    prepared: PreparedHeader | None, call_id: int, fields: tuple[Any, ...], payload: Payload
) -> list[Any]:
    """The frames of the `CallActor` of call `call_id` (`fields` after it) with `payload`."""
    if prepared is not None:
        return encode_prepared(prepared, call_id, payload)
    return encode_fields(CallActor, (call_id, *fields), payload)
