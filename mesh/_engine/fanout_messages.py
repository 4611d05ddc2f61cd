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
    """Caller → host agent: deliver `message` to each proc of `proc_ids` on this host, with
    the rank in the call at the same index of `ranks`; answers come back batched to
    `message.reply_to`. Columns of plain values, not pairs: checked and framed in C."""

    message: CallActor | StopActor
    proc_ids: tuple[str, ...]
    ranks: tuple[int, ...]


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class RelayedReplies:
    """Host agent → caller: answers to call `call_id`, the i-th one from rank `ranks[i]`, of
    kind `kinds[i]` ("" is a Reply, else the kind of a Failure), `sizes[i]` bytes of body and
    `counts[i]` out-of-band buffers. Payload: the answers' bodies one after the other, and
    their buffers in the same order. Columns of plain values: checked in C."""

    call_id: int
    ranks: tuple[int, ...]
    kinds: tuple[str, ...]
    sizes: tuple[int, ...]
    counts: tuple[int, ...]


#: The answers a relayed batch may hold: a call to more ranks is answered in several batches.
MAX_BATCH_ANSWERS = 4096


def pack_answers(
    call_id: int, answers: Sequence[tuple[int, str, Payload | None]]
) -> tuple[RelayedReplies, Payload]:
    """One message for several answers (rank, Failure kind or "", payload) to `call_id`."""
    ranks, kinds, sizes, counts = [], [], [], []
    bodies: list[bytes | memoryview] = []
    buffers: list[Any] = []
    for rank, kind, payload in answers:
        ranks.append(rank)
        kinds.append(kind)
        if payload is None:
            sizes.append(0)
            counts.append(0)
            continue
        sizes.append(len(payload.body))
        counts.append(len(payload.buffers))
        bodies.append(payload.body)
        buffers.extend(payload.buffers)
    header = RelayedReplies(call_id, tuple(ranks), tuple(kinds), tuple(sizes), tuple(counts))
    return header, Payload(b"".join(bodies), buffers)


#: One answer of a batch where it lies: rank, kind ("" for a Reply), body, buffers.
Part = tuple[int, str, memoryview, list[Any]]


def unpack_answers(envelope: Envelope) -> list[Envelope]:
    """The Reply and Failure envelopes a RelayedReplies carries, as if each came alone.
    Raises ValueError when its entries do not add up to its payload."""
    call_id = envelope.header.call_id
    return [
        Envelope(
            Reply(call_id, rank) if not kind else Failure(call_id, rank, kind),
            Payload(body, buffers) if body.nbytes or buffers else None,
        )
        for rank, kind, body, buffers in split_answers(envelope)
    ]


def split_answers(envelope: Envelope) -> list[Part]:
    """The answers a RelayedReplies carries, in order, as slices of its payload: no message
    built per answer (the caller settles them from these). Raises ValueError when its
    entries do not add up to its payload."""
    batch: RelayedReplies = envelope.header
    reason = invalid_fields(batch)
    if reason is not None:
        raise ValueError(f"a host agent sent a malformed batch of answers: {reason}")
    payload = envelope.payload or Payload(b"")
    body, buffers = memoryview(payload.body), list(payload.buffers)
    ranks, kinds, sizes, counts = batch.ranks, batch.kinds, batch.sizes, batch.counts
    if not len(ranks) == len(kinds) == len(sizes) == len(counts):
        raise ValueError(
            f"a batch of answers to call {batch.call_id} has {len(ranks)} ranks, {len(kinds)} "
            f"kinds, {len(sizes)} sizes and {len(counts)} buffer counts: one of each per answer"
        )
    wanted = sum(sizes), sum(counts)
    negative = min(sizes, default=0) < 0 or min(counts, default=0) < 0
    if wanted != (body.nbytes, len(buffers)) or negative or len(ranks) > MAX_BATCH_ANSWERS:
        raise ValueError(
            f"a batch of {len(ranks)} answers to call {batch.call_id} declares "
            f"{wanted[0]} bytes and {wanted[1]} buffers but carries {body.nbytes} and "
            f"{len(buffers)}"
        )
    parts: list[Part] = []
    start, first = 0, 0
    for rank, kind, size, count in zip(ranks, kinds, sizes, counts):
        end, last = start + size, first + count
        parts.append((rank, kind, body[start:end], buffers[first:last]))
        start, first = end, last
    return parts
