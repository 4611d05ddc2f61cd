"""The messages of fanned-out calls: one message per host agent instead of one per actor.

Caller → host agent: FanOut (a call or stop for several procs of that host; payload: the
call's, pickled once). Agent → its procs: the plain CallActor / StopActor, answered to the
agent. Agent → caller: RelayedReplies, the answers that arrived together, in one message.
The agent never unpickles anything: it moves the payload bytes as they came.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mesh._engine.messages import CallActor, Failure, Reply, StopActor, invalid_fields
from transport import Envelope, Payload, message_type


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class FanOut:
    """Caller → host agent: deliver `message` to each proc of `targets` (proc id, rank in the
    call) on this host, with that rank; answers come back batched to `message.reply_to`."""

    message: CallActor | StopActor
    targets: tuple[tuple[str, int], ...]


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class RelayedReplies:
    """Host agent → caller: answers to call `call_id`, one (rank, kind, body bytes, buffer
    count) per answer; kind "" is a Reply, else the kind of a Failure. Payload: the answers'
    bodies one after the other, and their out-of-band buffers in the same order."""

    call_id: int
    answers: tuple[tuple[int, str, int, int], ...]


#: The answers a relayed batch may hold: a call to more ranks is answered in several batches.
MAX_BATCH_ANSWERS = 4096


def pack_answers(
    call_id: int, answers: Sequence[tuple[int, str, Payload | None]]
) -> tuple[RelayedReplies, Payload]:
    """One message for several answers (rank, Failure kind or "", payload) to `call_id`."""
    entries: list[tuple[int, str, int, int]] = []
    bodies: list[bytes | memoryview] = []
    buffers: list[Any] = []
    for rank, kind, payload in answers:
        body = b"" if payload is None else payload.body
        more = () if payload is None else payload.buffers
        entries.append((rank, kind, len(body), len(more)))
        bodies.append(body)
        buffers.extend(more)
    return RelayedReplies(call_id, tuple(entries)), Payload(b"".join(bodies), buffers)


def unpack_answers(envelope: Envelope) -> list[Envelope]:
    """The Reply and Failure envelopes a RelayedReplies carries, as if each came alone.
    Raises ValueError when its entries do not add up to its payload."""
    batch: RelayedReplies = envelope.header
    reason = invalid_fields(batch)
    if reason is not None:
        raise ValueError(f"a host agent sent a malformed batch of answers: {reason}")
    payload = envelope.payload or Payload(b"")
    body, buffers = memoryview(payload.body), list(payload.buffers)
    wanted = sum(size for _, _, size, _ in batch.answers), sum(n for *_, n in batch.answers)
    if wanted != (body.nbytes, len(buffers)) or len(batch.answers) > MAX_BATCH_ANSWERS:
        raise ValueError(
            f"a batch of {len(batch.answers)} answers to call {batch.call_id} declares "
            f"{wanted[0]} bytes and {wanted[1]} buffers but carries {body.nbytes} and "
            f"{len(buffers)}"
        )
    envelopes, start, first = [], 0, 0
    for rank, kind, size, count in batch.answers:
        header: Any = Reply(batch.call_id, rank) if not kind else Failure(batch.call_id, rank, kind)
        part = Payload(body[start : start + size], buffers[first : first + count])
        envelopes.append(Envelope(header, part if size or count else None))
        start, first = start + size, first + count
    return envelopes
