"""The requests and replies of a replica group's key-value store (`_store_server`), as frames.

Plain bytes, never pickled: a request is a fixed header (magic, operation, request id, timeout)
and the operation's arguments, one frame each; a reply is the request id, a status and the
answer's frames. The operation's byte has its high bit set (`RESENT`) on a request sent again
after a reconnect, whose first copy may or may not have reached the store. `parse_request` is
the one check of a request, with the store's bounds; what fails it is answered with an error
naming the broken rule.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

MAGIC = b"MVS1"
_REQUEST = struct.Struct("!4sBQI")  # magic, operation, request id, timeout (ms)
_REPLY = struct.Struct("!QB")  # request id, status
_DELTA = struct.Struct("!q")

#: The store's bounds: a key, a value, the keys one request may name, the keys held, the bytes
#: held, the requests waiting for keys at once.
MAX_KEY_BYTES = 4096
MAX_VALUE_BYTES = 1 << 20
MAX_KEYS_PER_REQUEST = 1024
MAX_KEYS = 1 << 20
MAX_STORED_BYTES = 256 << 20
MAX_WAITING = 4096
#: The largest frame either side accepts (a larger one closes the connection that sent it).
MAX_FRAME_BYTES = MAX_VALUE_BYTES + 4096
#: The longest wait a request can ask for (the header's field), about 49 days.
MAX_TIMEOUT_MS = (1 << 32) - 1
#: The bit of the operation's byte that marks a request sent again.
RESENT = 0x80


class Op(enum.IntEnum):
    SET = 1  # key, value
    GET = 2  # key: waits for it
    WAIT = 3  # keys: waits for all
    ADD = 4  # key, delta (8 bytes, signed)
    CHECK = 5  # keys
    DELETE = 6  # key
    COMPARE_SET = 7  # key, expected, desired
    NUM_KEYS = 8
    DELETE_PREFIXES = 9  # prefixes: every key that starts with one of them goes


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1  # a bad request: the answer is the reason
    TIMEOUT = 2  # the keys waited for did not come in time
    FORGOTTEN = 3  # a write sent again that the store cannot tell it applied: not applied


#: How many argument frames each operation takes: (at least, at most).
_ARGUMENTS = {
    Op.SET: (2, 2),
    Op.GET: (1, 1),
    Op.WAIT: (1, MAX_KEYS_PER_REQUEST),
    Op.ADD: (2, 2),
    Op.CHECK: (1, MAX_KEYS_PER_REQUEST),
    Op.DELETE: (1, 1),
    Op.COMPARE_SET: (3, 3),
    Op.NUM_KEYS: (0, 0),
    Op.DELETE_PREFIXES: (1, MAX_KEYS_PER_REQUEST),
}


class BadRequest(ValueError):
    """A request that breaks the store's rules; `request_id` is 0 when even that is unknown."""

    def __init__(self, request_id: int, reason: str) -> None:
        super().__init__(reason)
        self.request_id = request_id


@dataclass(frozen=True)
class Request:
    op: Op
    request_id: int
    timeout_ms: int
    args: tuple[bytes, ...]
    resent: bool = False  # sent again after a reconnect: the store may have it already

    @property
    def keys(self) -> tuple[bytes, ...]:
        """The keys the request names (WAIT and CHECK name several, NUM_KEYS none)."""
        if self.op in (Op.WAIT, Op.CHECK, Op.DELETE_PREFIXES):
            return self.args
        return self.args[:1]


def encode_request(
    op: Op, request_id: int, timeout_ms: int, args: list[bytes], *, resent: bool = False
) -> list[bytes]:
    timeout_ms = min(max(timeout_ms, 0), MAX_TIMEOUT_MS)
    return [_REQUEST.pack(MAGIC, op | (RESENT if resent else 0), request_id, timeout_ms), *args]


def parse_request(frames: list[bytes]) -> Request:
    """The request `frames` hold, checked against the store's bounds; `BadRequest` if not."""
    if not frames or len(frames[0]) != _REQUEST.size:
        raise BadRequest(0, "not a store request: its header is missing or has the wrong size")
    magic, flagged_op, request_id, timeout_ms = _REQUEST.unpack(frames[0])
    if magic != MAGIC:
        raise BadRequest(0, f"not a store request: its header starts with {magic!r}")
    op = flagged_op & ~RESENT
    if op not in _ARGUMENTS:
        raise BadRequest(request_id, f"unknown store operation {op}")
    resent = bool(flagged_op & RESENT)
    request = Request(Op(op), request_id, timeout_ms, tuple(frames[1:]), resent)
    least, most = _ARGUMENTS[request.op]
    if not least <= len(request.args) <= most:
        raise BadRequest(
            request_id,
            f"{request.op.name} takes {least}..{most} arguments, not {len(request.args)}",
        )
    _check_sizes(request)
    return request


def _check_sizes(request: Request) -> None:
    long_key = next((key for key in request.keys if len(key) > MAX_KEY_BYTES), None)
    if long_key is not None:
        raise BadRequest(
            request.request_id,
            f"a key of {len(long_key)} bytes is longer than the store allows ({MAX_KEY_BYTES})",
        )
    if request.op == Op.DELETE_PREFIXES and not all(request.args):
        raise BadRequest(request.request_id, "DELETE_PREFIXES needs prefixes of one byte or more")
    if request.op == Op.ADD and len(request.args[1]) != _DELTA.size:
        raise BadRequest(request.request_id, "ADD needs its amount as 8 bytes")
    values = request.args[1:] if request.op in (Op.SET, Op.COMPARE_SET) else ()
    if any(len(value) > MAX_VALUE_BYTES for value in values):
        raise BadRequest(
            request.request_id,
            f"a value is larger than the store allows ({MAX_VALUE_BYTES} bytes)",
        )


def pack_delta(delta: int) -> bytes:
    return _DELTA.pack(delta)


def unpack_delta(data: bytes) -> int:
    return int(_DELTA.unpack(data)[0])


def encode_reply(request_id: int, status: Status, answer: list[bytes]) -> list[bytes]:
    return [_REPLY.pack(request_id, status), *answer]


def parse_reply(frames: list[bytes]) -> tuple[int, Status, list[bytes]]:
    """(request id, status, answer) of a reply; ValueError if it is not one."""
    if not frames or len(frames[0]) != _REPLY.size:
        raise ValueError("not a store reply: its header is missing or has the wrong size")
    request_id, status = _REPLY.unpack(frames[0])
    return request_id, Status(status), frames[1:]
