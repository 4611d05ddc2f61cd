"""`Replier`: tells callers how their call to an actor of this proc ended.

A value, an exception (the actor lives on) or a failure (the actor cannot serve the call). An
outcome that cannot be sent as it is (unpicklable, too large) is sent in a form that surely
can, and one that cannot reach its caller at all (no keys for its address, or a caller that
refuses this proc's keys: `HandshakeWaits`) is reported to the actor's owner (`ReplyLost`),
which ends that call if it made it: a caller must never wait forever because its answer could
not travel.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Iterator
from typing import Any

from mesh._engine.handshake_waits import HandshakeWaits
from mesh._engine.host_services import HostServices
from mesh._engine.hosted_actor import HostedActor
from mesh._engine.messages import EVERY_CALL, CallActor, Failure, Reply, ReplyLost, StopActor
from supervision import SupervisionEvent
from transport import (
    MessageTooLarge,
    Payload,
    PreparedHeader,
    SerializationError,
    TransportError,
    dump_value,
    dumps,
    encode,
    encode_fields,
    encode_prepared_value,
    get_logger,
    prepare_header,
    safe_str,
)

#: The call ids a prepared header packs (int64); any other goes through `encode_fields`.
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
#: What a `ReplyLost` names as the endpoint of a stop (no endpoint can be named so: it is a
#: method of meshes).
STOP = "stop"
#: The most ranks whose `Reply` header a replier keeps prepared.
_MOST_HEADS = 1024


class Replier:
    """Sends the outcome of calls (and the acknowledgement of stops) back to their callers."""

    def __init__(self, services: HostServices) -> None:
        self._services = services
        self._log = get_logger("mesh.actor")
        #: A `Reply` header prepared for each rank answered (all but the call id), so that a
        #: reply packs only its call id: one call, where `encode_fields` makes three.
        self._reply_heads: dict[int, PreparedHeader] = {}
        self._outbox = services.outbox
        self._waits = HandshakeWaits(
            services.outbox, services.call_soon, services.call_later, self._report_every_lost
        )

    def value(self, actor: HostedActor, header: CallActor, result: Any) -> None:
        """Send the result; one that cannot be sent (unpicklable, too large) fails the call."""
        reply_to = header.reply_to
        if reply_to is None:
            return
        try:  # one reply per call: the hot path
            head, call_id = self._reply_heads.get(header.rank), header.call_id
            if head is not None and type(call_id) is int and _I64_MIN <= call_id <= _I64_MAX:
                frames = encode_prepared_value(head, call_id, result)
            else:
                frames = self._reply_frames(header, dump_value(result))
        except Exception as exc:  # whatever pickling raises must not lose the call
            self.exception(actor, header, _unsendable_result(header, exc))
            return
        self._send_reply(actor, header, reply_to, frames)

    def reply_head(self, rank: int) -> PreparedHeader | None:
        """The `Reply` header of the calls sent to `rank`, prepared (None: it cannot be)."""
        return prepare_header(Reply, (rank,)) if type(rank) is int else None

    def value_prepared(
        self, actor: HostedActor, header: CallActor, head: PreparedHeader, result: Any
    ) -> None:
        """`value`, with the `Reply` header of the call's rank prepared (`reply_head`) and a
        call id that fits it (a lone call's: read as an int64)."""
        reply_to = header.reply_to
        if reply_to is None:
            return
        try:
            frames = encode_prepared_value(head, header.call_id, result)
        except Exception as exc:  # whatever pickling raises must not lose the call
            self.exception(actor, header, _unsendable_result(header, exc))
            return
        self._send_reply(actor, header, reply_to, frames)

    def _send_reply(
        self, actor: HostedActor, header: CallActor, reply_to: str, frames: list[Any]
    ) -> None:
        """Send the `Reply` `frames` of `header`'s call; an answer that cannot reach its caller
        (now, or once the caller's handshake is refused) is reported lost."""
        lost = self._services.send_frames(reply_to, Reply, frames, soon=bool(actor.mailbox))
        if lost is not None:
            self._report_lost(actor, header, lost)
        elif self._outbox.unconfirmed(reply_to):
            report = functools.partial(self._report_lost, actor, header)
            self._waits.watch(reply_to, report, actor.owner)

    def _reply_frames(self, header: CallActor, payload: Payload) -> list[Any]:
        """The frames of a `Reply` from its fields; prepares the header of the call's rank
        for the next replies (at most `_MOST_HEADS` ranks, then afresh: whatever peers send)."""
        heads, rank = self._reply_heads, header.rank
        if rank not in heads and type(rank) is int:
            head = prepare_header(Reply, (rank,))  # (None: a rank past 64 bits)
            if head is not None:
                if len(heads) >= _MOST_HEADS:
                    heads.clear()
                heads[rank] = head
        return encode_fields(Reply, (header.call_id, rank), payload)

    def exception(self, actor: HostedActor, header: CallActor, exc: BaseException) -> None:
        """Tell the caller its call raised `exc`: the exception itself where it can travel,
        else a description that surely can (an error that cannot be sent must not hang it)."""
        assert header.reply_to is not None
        failure = Failure(header.call_id, header.rank, "exception")
        error: Exception | None = None
        for detail in _exception_details(_exception_fields(actor, header, exc), exc):
            error = self._send_value(actor, header, failure, detail)
            if error is None:
                return
        self._log.error(
            "reply_lost", actor_id=actor.actor_id, call_id=header.call_id, reason=safe_str(error)
        )

    def failure(
        self,
        header: CallActor | StopActor,
        kind: str,
        detail: Any,
        actor: HostedActor | None = None,
    ) -> None:
        """Tell the caller the actor could not serve its call (`kind`: failed, stopped...).
        If that cannot reach the caller, `actor`'s owner is told, as of a lost answer, with
        `detail` (the actor's event) for the caller; without `actor` (one unknown here), this
        proc's agent is told, which hands it to the proc's owner."""
        if header.reply_to is None:
            return
        try:
            frames = encode(Failure(header.call_id, header.rank, kind), Payload.dump(detail))
        except TransportError as exc:
            self._log.error("reply_lost", call_id=header.call_id, reason=safe_str(exc))
            return
        lost = self._services.send_frames(header.reply_to, Failure, frames)
        event = detail if isinstance(detail, SupervisionEvent) else None
        self._sent(actor, header, lost, event)

    def stopped(self, actor: HostedActor, header: StopActor) -> None:
        """Acknowledge a stop, to whoever waits for it; one that cannot reach them is reported
        to the actor's owner like a lost answer, which ends that wait (the actor did stop)."""
        if header.reply_to is not None:
            frames = encode(Reply(header.call_id, header.rank), Payload.dump(None))
            self._sent(actor, header, self._services.send_frames(header.reply_to, Reply, frames))

    def _sent(
        self,
        actor: HostedActor | None,
        call: CallActor | StopActor,
        lost: TransportError | None,
        event: SupervisionEvent | None = None,
    ) -> None:
        """An answer to `call` was sent: report it lost if it could not go (`lost`: why), or
        watch the handshake of a caller that has not passed it yet."""
        assert call.reply_to is not None
        if lost is not None:
            self._report_lost(actor, call, lost, event)
        elif self._outbox.unconfirmed(call.reply_to):
            report = functools.partial(self._report_lost, actor, call, event=event)
            self._waits.watch(call.reply_to, report, self._told_of_loss(actor))

    def _send_value(
        self, actor: HostedActor, call: CallActor, header: Any, value: Any, *, soon: bool = False
    ) -> Exception | None:
        """Send `value` with `header` in answer to `call`, or return why it cannot go
        (serialization, size). `soon`: the reply may wait in a batch (more calls are queued,
        from pipelining). One that cannot reach the caller is reported to the owner."""
        try:
            frames = encode(header, Payload.dump(value))
        except Exception as exc:  # whatever pickling raises must not lose the call
            return exc
        assert call.reply_to is not None
        self._sent(
            actor, call, self._services.send_frames(call.reply_to, type(header), frames, soon=soon)
        )
        return None

    def _report_lost(
        self,
        actor: HostedActor | None,
        call: CallActor | StopActor,
        error: TransportError,
        event: SupervisionEvent | None = None,
    ) -> None:
        """The answer to `call` cannot reach its caller: tell the actor's owner, which ends
        the call if it is its own (its process is reachable from here: it spawned the actor),
        else sends the caller `event` (None: the actor's "unreachable" one). Without `actor`
        (none such here), this proc's agent is told: it hands that on to the proc's owner."""
        assert call.reply_to is not None
        reason, proc_id = clip(safe_str(error)), self._services.proc_id
        endpoint = call.endpoint if isinstance(call, CallActor) else STOP
        lost = ReplyLost(call.call_id, call.rank, call.reply_to, proc_id, endpoint, reason)
        why = (
            f"its answer to call {call.call_id} of endpoint {endpoint!r} could not be "
            f"sent from proc {proc_id} to {call.reply_to}: {reason}"
        )
        if actor is not None:
            event = actor.make_event("unreachable", why) if event is None else event
        self._tell_of_loss(self._told_of_loss(actor), lost, event)

    def _report_every_lost(self, owner: str, reply_to: str, error: TransportError) -> None:
        """Every answer from here to `reply_to` was refused, more than `HandshakeWaits` keeps
        one by one: `owner` is told once, and ends every call made there that waits here."""
        reason, proc_id = clip(safe_str(error)), self._services.proc_id
        lost = ReplyLost(EVERY_CALL, EVERY_CALL, reply_to, proc_id, "", reason)
        self._tell_of_loss(owner, lost, None)

    def _told_of_loss(self, actor: HostedActor | None) -> str:
        """Who is told of a lost answer of `actor`: its owner; for none, this proc's agent
        (it hands that on to the proc's owner); "": nobody can be."""
        return actor.owner if actor is not None else self._services.agent or ""

    def _tell_of_loss(self, to: str, lost: ReplyLost, event: SupervisionEvent | None) -> None:
        if to:
            self._services.send_message(to, lost, Payload.dump(event))
        else:
            self._log.error("reply_lost", call_id=lost.call_id, to=lost.reply_to, why=lost.reason)


def _exception_fields(actor: HostedActor, header: CallActor, exc: BaseException) -> dict[str, Any]:
    return {
        "exception_type": type(exc).__qualname__,
        "message": safe_str(exc),
        "remote_traceback": format_traceback(exc),
        "mesh_name": actor.mesh_name,
        "rank": dict(actor.point),
        "call_rank": dict(actor.call_context(header).rank),
        "actor_id": actor.actor_id,
        "endpoint": header.endpoint,
        "host": actor.home.host,
        "pid": actor.home.pid,
    }


def _pickled_or_none(value: object) -> bytes | None:
    """`value` pickled in-band, or None when it cannot be (the caller then does without)."""
    try:
        body, buffers = dumps(value)
    except Exception:
        return None
    return None if buffers else body


def _exception_details(fields: dict[str, Any], exc: BaseException) -> Iterator[tuple[Any, ...]]:
    """What a caller is told of `exc`, from everything to what surely fits in a message."""
    exception_class = _pickled_or_none(type(exc))
    yield fields, _pickled_or_none(exc), exception_class
    clipped = {
        **fields,
        "message": clip(fields["message"]),
        "remote_traceback": clip(fields["remote_traceback"]),
    }
    yield clipped, None, exception_class
    yield clipped, None, None


def _unsendable_result(header: CallActor, error: Exception) -> TransportError:
    """The error a caller gets for a result that could not be sent back; it keeps the
    transport's error type (SerializationError, MessageTooLarge), so it can be caught as such."""
    where = f"the result of endpoint {header.endpoint!r}"
    wrapped: TransportError
    if isinstance(error, MessageTooLarge):
        wrapped = MessageTooLarge(f"{where} could not be sent back: {safe_str(error)}")
    elif isinstance(error, SerializationError):
        wrapped = SerializationError(f"{where} could not be serialized: {safe_str(error)}")
    else:
        why = f"{type(error).__name__}: {safe_str(error)}"
        wrapped = SerializationError(f"{where} could not be serialized: {why}")
    wrapped.__cause__ = error
    return wrapped


def format_traceback(exc: BaseException) -> str:
    """The formatted traceback of `exc`, or why it could not be formatted."""
    try:
        return "".join(traceback.format_exception(exc))
    except Exception as error:
        return f"<the traceback could not be formatted: {type(error).__name__}>"


#: The longest message or traceback text sent when the full one does not fit.
_CLIP_CHARS = 8000


def clip(text: str) -> str:
    """`text`, or its beginning and end when it is longer than `_CLIP_CHARS`."""
    if len(text) <= _CLIP_CHARS:
        return text
    half = _CLIP_CHARS // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters left out ...]\n{text[-half:]}"
