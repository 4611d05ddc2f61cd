"""`FanOutRelay`: the host agent's half of fanned-out calls (see `mesh/_engine/fanout.py`).

A caller sends one `FanOut` for several procs of this host; the agent delivers the call to
each of them (the payload's bytes as they came: the agent never unpickles them), asking for
the answers itself. Answers that arrive together go back to the caller in one
`RelayedReplies` per call. What one pass over the agent's inbox sends leaves at its end, one
frame per proc and per caller (`flush`): procs wake once per batch of calls, not per call.
Answers to a call that still awaits others wait up to `HOLD_S` for them, so that the caller
wakes for a few batches per call rather than one per pass (a call's last answer never waits).
A proc that exits is dropped from the calls it was in: its caller
fails that rank from the proc's exit report, as for a call sent to it directly.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
import sys
import time
from collections.abc import Callable
from typing import Any

from mesh._agent.procs import ProcRecord, ProcTable
from mesh._agent.relay_handshakes import RelayHandshakes
from mesh._agent.shared_segments import SharedSegments
from mesh._engine.fanout_messages import MAX_BATCH_ANSWERS, FanOut, pack_answers
from mesh._engine.messages import (
    EVERY_CALL,
    CallActor,
    Failure,
    InboxClosed,
    Reply,
    ReplyLost,
    StopActor,
)
from mesh._engine.payload_arena import ArenaCall
from mesh._engine.shared_payload import SharedCall, call_fields
from transport import (
    Envelope,
    LoneInbox,
    Outbox,
    Payload,
    TransportError,
    encode,
    encode_fields,
    encode_prepared_last,
    is_address,
    prepare_header_but_last,
    transport_settings,
)

#: The most bytes of answers one batch carries (less with a lower message size limit).
MAX_BATCH_BYTES = 1 << 20
#: An answer larger than this goes on alone, as it came: batching would copy it for nothing.
MAX_SHARED_BYTES = 64 << 10

#: The largest rank a prepared header packs (a signed 64-bit int).
_MAX_I64 = 2**63 - 1

#: How long answers to a call wait for its other answers before they leave without them.
HOLD_S = 0.002

Answer = tuple[int, str, Payload | None]
#: The fields of the headers that name where a shared payload lies, by type.
_PLACED_FIELDS = {
    kind: operator.attrgetter(*(f.name for f in dataclasses.fields(kind)))
    for kind in (ArenaCall, SharedCall)
}
#: Where the rank lies among those fields (each proc gets its own).
_RANK_AT = {
    kind: [f.name for f in dataclasses.fields(kind)].index("rank") for kind in _PLACED_FIELDS
}


class _Relayed:
    """One fanned-out call awaiting answers: whose call it is, and the procs not done yet."""

    __slots__ = (
        "answers",
        "call_id",
        "endpoint",
        "held_since",
        "nbytes",
        "procs",
        "reply_to",
        "waiting",
    )

    def __init__(self, call_id: int, reply_to: str, endpoint: str) -> None:
        self.call_id = call_id
        self.reply_to = reply_to
        self.endpoint = endpoint
        self.waiting: dict[int, str] = {}  # rank in the call -> proc id
        self.procs: dict[int, str] = {}  # the same, answered or not
        self.answers: list[Answer] = []  # arrived, not sent on yet
        self.nbytes = 0
        self.held_since = 0.0  # when the first of `answers` arrived


class FanOutRelay:
    """Delivers fanned-out calls to this agent's procs and sends their answers back batched."""

    def __init__(
        self, procs: ProcTable, outbox: Outbox, address: str, log: Any, hold_s: float = HOLD_S
    ) -> None:
        self._procs = procs
        self._hold_s = hold_s
        self._outbox = outbox
        self._address = address
        self._log = log
        self._calls: dict[int, _Relayed] = {}  # by the call id the procs answer
        self._ids = itertools.count(1)
        self._answered: dict[int, _Relayed] = {}  # calls with answers to send
        self._early: dict[str, list[list[Any]]] = {}  # for tcp procs whose port is not known
        self._shared = SharedSegments(log)  # large payloads: one memory file, not N copies
        self._handshakes = RelayHandshakes(outbox, self._every_lost)  # callers with other keys
        limit = transport_settings().max_message_bytes  # a batch must stay within it
        self._batch_bytes = min(MAX_BATCH_BYTES, limit // 2)
        self._alone_bytes = min(MAX_SHARED_BYTES, limit // 4)

    def handle(self, envelope: Envelope) -> bool:
        """Act on `envelope` if it is part of fanned-out calls; whether it was."""
        kind = type(envelope.header)
        if kind is FanOut:
            self._fan_out(envelope.header, envelope.payload)
        elif kind is Reply or kind is Failure:
            header, payload = envelope.header, envelope.payload
            failure = header.kind if kind is Failure else None
            size = 0 if payload is None else payload.nbytes
            self._answer(header.call_id, header.rank, failure, payload, size)
        elif kind is InboxClosed:
            self._inbox_closed(envelope.header.address)
        else:
            return False
        return True

    def _fan_out(self, request: FanOut, payload: Payload | None) -> None:
        message = request.message
        reason = _bad_fan_out(request)
        if reason is not None:
            self._log.warning("message_rejected", kind="FanOut", reason=reason)
            return
        relay_id, reply_to = message.call_id, None
        if message.reply_to is not None:
            reply_to = self._address  # the procs answer here
            relay_id = next(self._ids)
            endpoint = message.endpoint if type(message) is CallActor else "stop"
            relayed = self._calls[relay_id] = _Relayed(message.call_id, message.reply_to, endpoint)
        relayed_message = _for_rank(message, relay_id, reply_to, 0)
        shared = self._shared.share(relay_id, relayed_message, payload, len(request.ranks))
        frames_for = _frames_for(relayed_message, shared, payload, request.ranks)
        for proc_id, rank in zip(request.proc_ids, request.ranks):
            proc = self._procs.get(proc_id)
            if proc is None:  # gone: its exit report tells the caller
                continue
            if message.reply_to is not None:
                relayed.waiting[rank] = relayed.procs[rank] = proc_id
            if shared is not None:
                self._shared.expect(relay_id, rank, proc_id)
            self._deliver(proc, frames_for(rank))
        if shared is not None:
            self._shared.sent(relay_id)
        if message.reply_to is not None and not relayed.waiting:
            del self._calls[relay_id]

    def _deliver(self, proc: ProcRecord, frames: list[Any]) -> None:
        if proc.connected or "*" not in proc.address:  # in a batch, until this pass's `flush`
            self._send(proc.address, frames, soon=True)
        else:  # a tcp proc that has not said which port it took: wait for it
            self._early.setdefault(proc.proc_id, []).append(frames)

    def drain(self, inbox: LoneInbox, take: Callable[[Envelope], None]) -> None:
        """Take every message waiting in `inbox`, in order: a proc's `Reply` alone in its
        frame read here as its ints and body (no header, payload or envelope built: the
        bulk of a call to all), anything else handed to `take`; then `flush`."""
        while (got := inbox.receive_lone_nowait()) is not None:
            if type(got) is tuple:
                call_id, rank, body = got
                size = body.nbytes
                self._answer(call_id, rank, None, Payload(body) if size else None, size)
            else:
                take(got)  # type: ignore[arg-type]
        self.flush()

    def _answer(
        self, call_id: int, rank: int, kind: str | None, payload: Payload | None, size: int
    ) -> None:
        """A proc's answer to relayed call `call_id`: a `Reply` (`kind` None) or a
        `Failure` of that kind, with `payload` of `size` bytes."""
        self._shared.answered(call_id, rank)
        relayed = self._calls.get(call_id)
        if relayed is None or relayed.waiting.pop(rank, None) is None:
            self._log.warning("answer_ignored", call=call_id, rank=rank)
            return
        if not relayed.waiting:
            del self._calls[call_id]
        if size > self._alone_bytes:  # large: on its own, as the proc sent it
            frames = encode(_answer_to(relayed, rank, kind), payload)
            self._lost(relayed, [(rank,)], self._send(relayed.reply_to, frames))
            return
        if relayed.nbytes + size > self._batch_bytes:
            self._send_answers(relayed)
        if not relayed.answers:
            relayed.held_since = time.monotonic()
        relayed.answers.append((rank, "" if kind is None else kind, payload))
        relayed.nbytes += size
        self._answered[call_id] = relayed
        if len(relayed.answers) >= MAX_BATCH_ANSWERS:
            self._send_answers(relayed)

    def flush(self) -> None:
        """Send the answers that arrived (one message per call; those of a call still
        awaiting others once held `hold_s`), and the calls that waited for their tcp procs to
        be ready. Called each time the agent's inbox is drained."""
        if self._handshakes.waiting:
            self._handshakes.check()
        held_until = time.monotonic() - self._hold_s
        for relay_id, relayed in list(self._answered.items()):
            if not relayed.waiting or relayed.held_since <= held_until or not relayed.answers:
                self._send_answers(relayed, soon=True)
                del self._answered[relay_id]
        for proc_id in [p for p in self._early if self._ready(p)]:
            proc = self._procs.get(proc_id)
            for frames in self._early.pop(proc_id):
                if proc is not None:
                    self._send(proc.address, frames)
        self._outbox.flush()  # each proc gets this pass's calls, each caller its answers, at once

    def due_in(self, longest: float) -> float:
        """Seconds until held answers must leave (a `flush` then), at most `longest`."""
        longest = self._handshakes.due_in(longest)
        if not self._answered:
            return longest
        first = min(relayed.held_since for relayed in self._answered.values())
        return max(0.0, min(longest, first + self._hold_s - time.monotonic()))

    def _ready(self, proc_id: str) -> bool:
        proc = self._procs.get(proc_id)
        return proc is None or proc.connected

    def _send_answers(self, relayed: _Relayed, soon: bool = False) -> None:
        if relayed.answers:
            answers, relayed.answers, relayed.nbytes = relayed.answers, [], 0
            header, payload = pack_answers(relayed.call_id, answers)
            frames = encode(header, payload, max_bytes=sys.maxsize)
            self._lost(relayed, answers, self._send(relayed.reply_to, frames, soon=soon))

    def _lost(self, relayed: _Relayed, answers: list[Any], error: TransportError | None) -> None:
        """`answers` (rank first) could not be sent on to the caller (`error`; None: they
        were): each proc's owner is told (`ReplyLost`), which ends that call or forwards why.
        Sent to a caller whose handshake has not passed, they are watched: it may refuse them."""
        if error is None:
            if self._outbox.unconfirmed(relayed.reply_to):
                self._watch_handshake(relayed, answers)
            return
        reason = f"its host agent {self._address} could not send it on: {error}"
        for rank, *_ in answers:
            proc_id = relayed.procs.get(rank, "")
            proc = self._procs.get(proc_id)
            if proc is None:  # gone: its exit report ends the call
                continue
            lost = ReplyLost(
                relayed.call_id, rank, relayed.reply_to, proc_id, relayed.endpoint, reason
            )
            self._send(proc.owner, encode(lost, Payload.dump(None)))

    def _watch_handshake(self, relayed: _Relayed, answers: list[Any]) -> None:
        """Report `answers` lost if their caller refuses this agent's handshake."""
        ranks = [(rank,) for rank, *_ in answers]  # not their payloads: kept a while
        refused = functools.partial(self._lost, relayed, ranks)
        owners = functools.partial(self._owners, relayed, ranks)
        self._handshakes.watch(relayed.reply_to, refused, owners)

    def _owners(self, relayed: _Relayed, ranks: list[Any]) -> list[tuple[str, str]]:
        """(owner, proc id) of the procs that gave the answers of `ranks` (those still here)."""
        procs = [self._procs.get(relayed.procs.get(rank, "")) for rank, *_ in ranks]
        return [(proc.owner, proc.proc_id) for proc in procs if proc is not None]

    def _every_lost(self, owner: str, proc_id: str, reply_to: str, error: TransportError) -> None:
        """Every answer of `proc_id` sent on to `reply_to` was refused: its owner ends each
        call made there that waits on it (`ReplyLost` for every call)."""
        reason = f"its host agent {self._address} could not send it on: {error}"
        lost = ReplyLost(EVERY_CALL, EVERY_CALL, reply_to, proc_id, "", reason)
        self._send(owner, encode(lost, Payload.dump(None)))

    def proc_exited(self, proc_id: str) -> None:
        """`proc_id` exited: the calls it was in no longer wait for it, and the answers held
        leave now, ahead of the exit report that follows (one it gave must not come after)."""
        self._early.pop(proc_id, None)
        self._shared.proc_exited(proc_id)
        for relay_id, relayed in list(self._calls.items()):
            for rank in [r for r, p in relayed.waiting.items() if p == proc_id]:
                del relayed.waiting[rank]
            if not relayed.waiting:
                del self._calls[relay_id]
        for relayed in self._answered.values():
            self._send_answers(relayed, soon=True)
        self._answered.clear()
        self._outbox.flush()

    def _inbox_closed(self, address: str) -> None:
        """A caller's reply inbox is gone: forget its calls and the connection to it."""
        for relay_id, relayed in list(self._calls.items()):
            if relayed.reply_to == address:
                del self._calls[relay_id]
        for relay_id, relayed in list(self._answered.items()):
            if relayed.reply_to == address:
                del self._answered[relay_id]
        self._outbox.forget(address)

    def _send(self, address: str, frames: list[Any], soon: bool = False) -> TransportError | None:
        """Send `frames`; `soon`: small ones may wait in a batch until the next `flush`. Why
        they could not be sent (logged), or None."""
        try:
            if soon:
                self._outbox.send_soon(address, frames)
            else:
                self._outbox.send(address, frames)
        except TransportError as exc:
            self._log.warning("send_failed", to=address, reason=str(exc))
            return exc
        return None


def _answer_to(relayed: _Relayed, rank: int, kind: str | None) -> Reply | Failure:
    """A proc's answer to the agent (`kind` None: a `Reply`), as an answer to the caller's."""
    if kind is None:
        return Reply(relayed.call_id, rank)
    return Failure(relayed.call_id, rank, kind)


def _for_rank(
    message: CallActor | StopActor, call_id: int, reply_to: str | None, rank: int
) -> CallActor | StopActor:
    """`message` as the proc of rank `rank` gets it, answering `call_id` at `reply_to`."""
    if type(message) is CallActor:
        labels, sizes = message.labels, message.sizes
        return CallActor(call_id, reply_to, message.actor_id, message.endpoint, labels, sizes, rank)
    return StopActor(call_id, reply_to, message.actor_id, rank)


def _frames_for(
    message: CallActor | StopActor,
    shared: SharedCall | ArenaCall | None,
    payload: Payload | None,
    ranks: tuple[int, ...],
) -> Callable[[int], list[Any]]:
    """``frames(rank)``: the message the proc of `rank` (one of `ranks`) gets, `message` for
    its rank with its payload (`shared`: where it lies). Built from the fields, not from a
    header per proc: a call's header is encoded once, and each proc's packs only its rank."""
    if shared is not None:
        kind = type(shared)
        fields = _PLACED_FIELDS[kind](shared)
        at = _RANK_AT[kind]
        head, tail = fields[:at], fields[at + 1 :]
        if not tail:  # the rank is the last field of `ArenaCall` and `SharedCall`
            return _rank_last(kind, head, None, ranks)
        return lambda rank: encode_fields(kind, (*head, rank, *tail), None)
    if type(message) is CallActor:
        return _rank_last(CallActor, call_fields(message)[:6], payload, ranks)
    return lambda rank: encode(_with_rank(message, rank), payload)


def _rank_last(
    kind: type, head: tuple[Any, ...], payload: Payload | None, ranks: tuple[int, ...]
) -> Callable[[int], list[Any]]:
    """``frames(rank)`` for a `kind` message whose fields are `head` and then the rank: its
    header encoded once, each proc's packing only its rank."""
    prepared = prepare_header_but_last(kind, head)
    if prepared is not None and max(ranks, default=0) <= _MAX_I64:
        return lambda rank: encode_prepared_last(prepared, rank, payload)
    return lambda rank: encode_fields(kind, (*head, rank), payload)


def _with_rank(message: Any, rank: int) -> Any:
    """`message` (a `CallActor` or `StopActor`) for the proc of rank `rank`."""
    return dataclasses.replace(message, rank=rank)


def _bad_fan_out(request: FanOut) -> str | None:
    """Why the agent must refuse `request` (its fields' types are checked already), or None."""
    message = request.message
    if message.reply_to is not None and not is_address(message.reply_to):
        return f"reply_to {message.reply_to[:60]!r} is not a meshvisor address"
    sizes = message.sizes if isinstance(message, CallActor) else None
    ranks = request.ranks
    if len(request.proc_ids) != len(ranks):
        return f"{len(request.proc_ids)} proc ids for {len(ranks)} ranks: one rank per proc"
    limit = math.inf if sizes is None else math.prod(sizes)
    if ranks and not (min(ranks) >= 0 and max(ranks) < limit):
        return f"a target's rank is outside the sizes {sizes!r} of the call"
    if len(set(ranks)) != len(ranks):
        return "two targets have the same rank"
    return None
