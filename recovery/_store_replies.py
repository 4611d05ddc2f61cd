"""The last answer the store gave each requester to a request that changes it, kept so that a
request sent again after a reconnect is answered, not applied twice.

A requester whose connection closed with a request in flight cannot know whether the store
applied it: it sends it again, with the same request id, down a new connection. A read (GET,
WAIT, CHECK, NUM_KEYS) is simply answered again. A write (SET, ADD, COMPARE_SET, DELETE,
DELETE_PREFIXES) is answered immediately and its answer kept here, by requester; the same
request again gets that answer back, so that a write in flight is applied at most once, and
its caller learns its result either way. A requester asks one request at a time, so its last
write is the only one it can send again. Bounded: the oldest requesters' answers go first.

A request sent again says so (`Request.resent`). When the store no longer holds its
requester's last write (gone to make room, or never seen: the store cannot tell which), a
write sent again may have been applied before: it is refused (`Status.FORGOTTEN`), never
applied a second time. When the store holds an older write of that requester, this one never
reached it, and is applied.
"""

from __future__ import annotations

from collections import OrderedDict

from ._store_wire import Op, Request, Status, encode_reply

#: Operations that change the store: applied once, their answer kept.
WRITES = frozenset({Op.SET, Op.ADD, Op.COMPARE_SET, Op.DELETE, Op.DELETE_PREFIXES})
#: How many requesters' answers are kept, and how many bytes of answers in all.
MAX_REQUESTERS = 4096
MAX_KEPT_BYTES = 32 << 20


class LastWrites:
    """Each requester's last write: its request id and the reply it got."""

    def __init__(self) -> None:
        self._kept: OrderedDict[bytes, tuple[int, list[bytes]]] = OrderedDict()
        self._bytes = 0

    def replay(self, asker: bytes, request: Request) -> list[bytes] | None:
        """The reply to `request` without applying it: the one `asker` got if the store applied
        it already, a refusal if it was sent again and the store cannot tell; None: apply it."""
        if request.op not in WRITES:
            return None
        kept = self._kept.get(asker)
        if kept is not None and kept[0] == request.request_id:
            return kept[1]
        if request.resent and (kept is None or kept[0] > request.request_id):
            return encode_reply(request.request_id, Status.FORGOTTEN, [_forgotten(request)])
        return None

    def keep(self, asker: bytes, request: Request, reply: list[bytes]) -> None:
        """Remember `reply`, the answer to `asker`'s write `request`."""
        if request.op not in WRITES:
            return
        self._drop(asker)
        self._kept[asker] = (request.request_id, reply)
        self._bytes += _size(reply)
        while len(self._kept) > MAX_REQUESTERS or self._bytes > MAX_KEPT_BYTES:
            self._drop(next(iter(self._kept)))

    def _drop(self, asker: bytes) -> None:
        kept = self._kept.pop(asker, None)
        if kept is not None:
            self._bytes -= _size(kept[1])


def _size(reply: list[bytes]) -> int:
    return sum(len(frame) for frame in reply)


def _forgotten(request: Request) -> bytes:
    why = (
        f"{request.op.name} (request {request.request_id}) was sent again after a reconnect, "
        "and the store no longer remembers whether it applied the first copy (it keeps the "
        f"last write of {MAX_REQUESTERS} clients, {MAX_KEPT_BYTES >> 20} MiB of answers at "
        "most): it was not applied again; read the key to see whether the write took effect"
    )
    return why.encode()
