"""What a replica group's key-value store holds, and its answers (no sockets, no threads).

The semantics are c10d's: `get` and `wait` answer once their keys exist, or with a timeout
when the request's own timeout passes first; `add` keeps the value as a decimal number;
`compare_set` sets when the value is the expected one (a missing key counts as empty).
Everything is bounded (`_store_wire`): what would break a bound is answered with an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ._store_wire import (
    MAX_KEYS,
    MAX_STORED_BYTES,
    MAX_WAITING,
    BadRequest,
    Op,
    Request,
    Status,
    encode_reply,
    unpack_delta,
)

#: (the asker's identity, the reply's frames)
Answer = tuple[bytes, list[bytes]]


@dataclass(frozen=True)
class Waiting:
    """A GET or WAIT whose keys are not all there yet: answered when they are, or at
    `deadline` (time.monotonic) with a timeout."""

    asker: bytes
    request: Request
    deadline: float


class StoreState:
    """The keys and values, and the requests waiting for keys."""

    def __init__(self) -> None:
        self._values: dict[bytes, bytes] = {}
        self._bytes = 0
        self._waiting: list[Waiting] = []

    def answer(self, asker: bytes, request: Request, now: float) -> list[Answer]:
        """The replies `request` from `asker` brings: its own (unless it waits now), and those
        of waiting requests whose keys it set."""
        try:
            status, answer = self._apply(request)
        except BadRequest as exc:
            return [(asker, encode_reply(request.request_id, Status.ERROR, [str(exc).encode()]))]
        if status is None:
            return self._wait(asker, request, now)
        replies = [(asker, encode_reply(request.request_id, status, answer))]
        if request.op in (Op.SET, Op.ADD, Op.COMPARE_SET):
            replies += self._now_answered()
        return replies

    def expire(self, now: float) -> list[Answer]:
        """The timeouts of the waiting requests whose deadline has passed."""
        expired = [waiting for waiting in self._waiting if waiting.deadline <= now]
        self._waiting = [waiting for waiting in self._waiting if waiting.deadline > now]
        return [(w.asker, _timed_out(w.request)) for w in expired]

    def forget(self, askers: set[bytes]) -> None:
        """Drop the waiting requests of `askers`, gone: no one would read their answers."""
        if askers:
            self._waiting = [waiting for waiting in self._waiting if waiting.asker not in askers]

    def waiting(self) -> int:
        return len(self._waiting)

    def next_deadline(self) -> float | None:
        return min((waiting.deadline for waiting in self._waiting), default=None)

    def drop_waiting(self) -> Iterator[Answer]:
        """Every waiting request, answered with an error: the store is closing."""
        why = b"the store closed: its replica group stopped"
        for waiting in self._waiting:
            yield waiting.asker, encode_reply(waiting.request.request_id, Status.ERROR, [why])
        self._waiting = []

    def _apply(self, request: Request) -> tuple[Status | None, list[bytes]]:
        """The status and answer of `request` (None: it must wait for its keys)."""
        op, args = request.op, request.args
        if op == Op.SET:
            self._put(args[0], args[1])
        elif op in (Op.GET, Op.WAIT):
            if not all(key in self._values for key in request.keys):
                return None, []
            return Status.OK, self._found(request)
        elif op == Op.ADD:
            return Status.OK, [self._add(request)]
        elif op == Op.CHECK:
            return Status.OK, [b"1" if all(key in self._values for key in args) else b"0"]
        elif op == Op.DELETE:
            return Status.OK, [b"1" if self._delete(args[0]) else b"0"]
        elif op == Op.COMPARE_SET:
            return Status.OK, [self._compare_set(*args)]
        elif op == Op.DELETE_PREFIXES:
            return Status.OK, [str(self._delete_prefixes(args)).encode()]
        elif op == Op.NUM_KEYS:
            return Status.OK, [str(len(self._values)).encode()]
        return Status.OK, []

    def _put(self, key: bytes, value: bytes) -> None:
        old = self._values.get(key)
        size = self._bytes + len(value) + (len(key) if old is None else -len(old))
        if old is None and len(self._values) >= MAX_KEYS:
            raise BadRequest(0, f"the store holds {MAX_KEYS} keys, its most; delete some first")
        if size > MAX_STORED_BYTES:
            raise BadRequest(0, f"the store would hold more than {MAX_STORED_BYTES} bytes")
        self._values[key] = value
        self._bytes = size

    def _delete(self, key: bytes) -> bool:
        value = self._values.pop(key, None)
        if value is None:
            return False
        self._bytes -= len(key) + len(value)
        return True

    def _delete_prefixes(self, prefixes: tuple[bytes, ...]) -> int:
        """Delete every key that starts with one of `prefixes`; how many went."""
        doomed = [key for key in self._values if key.startswith(prefixes)]
        for key in doomed:
            self._delete(key)
        return len(doomed)

    def _add(self, request: Request) -> bytes:
        key, delta = request.args[0], unpack_delta(request.args[1])
        current = self._values.get(key, b"0")
        try:
            total = int(current) + delta
        except ValueError:
            raise BadRequest(
                request.request_id, f"cannot add to key {key!r}: its value is not a number"
            ) from None
        try:
            text = str(total).encode()
        except ValueError:  # more digits than Python writes (4300 by default)
            raise BadRequest(
                request.request_id, f"cannot add to key {key!r}: the sum has too many digits"
            ) from None
        self._put(key, text)
        return text

    def _compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        current = self._values.get(key)
        if current is None and expected:
            return expected  # c10d's answer for a missing key that was expected to be set
        if (current or b"") != expected:
            return current or b""
        self._put(key, desired)
        return desired

    def _wait(self, asker: bytes, request: Request, now: float) -> list[Answer]:
        if request.timeout_ms == 0:
            return [(asker, _timed_out(request))]
        if len(self._waiting) >= MAX_WAITING:
            why = f"{MAX_WAITING} requests already wait for keys, the store's most"
            return [(asker, encode_reply(request.request_id, Status.ERROR, [why.encode()]))]
        # the same request again (sent again after a reconnect): one wait, the newest
        self._waiting = [
            w
            for w in self._waiting
            if (w.asker, w.request.request_id) != (asker, request.request_id)
        ]
        self._waiting.append(Waiting(asker, request, now + request.timeout_ms / 1000))
        return []

    def _now_answered(self) -> list[Answer]:
        ready: list[Waiting] = []
        still: list[Waiting] = []
        for waiting in self._waiting:
            present = all(key in self._values for key in waiting.request.keys)
            (ready if present else still).append(waiting)
        self._waiting = still
        return [
            (w.asker, encode_reply(w.request.request_id, Status.OK, self._found(w.request)))
            for w in ready
        ]

    def _found(self, request: Request) -> list[bytes]:
        """The answer of a GET or WAIT whose keys are all there."""
        return [self._values[request.args[0]]] if request.op == Op.GET else []


def _timed_out(request: Request) -> list[bytes]:
    keys = ", ".join(key.decode(errors="replace") for key in request.keys)
    why = f"wait timeout after {request.timeout_ms}ms, keys: {keys}"
    return encode_reply(request.request_id, Status.TIMEOUT, [why.encode()])
