"""`StoreClient`: a `torch.distributed.Store` that asks a replica group's `StoreServer`.

gloo's rendezvous uses `set`, `wait` (with its own timeout) and `get` (with the store's);
abort notices use `set`, `check` and `get`; `add`, `delete_key`, `compare_set`, `num_keys` and
`clone` complete c10d's set, and torch builds `multi_get`, `multi_set`, `append` and `barrier`
on them (queues and `list_keys` it refuses itself). Every call ends within its timeout: a key
that does not come, a server that does not answer or went away (its controller died) raise
`DistStoreError` or `DistNetworkError`, as torch's stores do, so that gloo reports a timeout.
A connection that closes while its process lives on (a pause of either side past the store's
heartbeat timeout) is opened again, and the request in flight sent again within its timeout;
the store applies it at most once (`_store_replies`). A call made after the store's process
ended, in flight or not, ends at once: its attempts to connect are refused.
Any thread may call: each has a connection of its own; any thread may `close` (a call in
flight ends as it would have, and its connection closes then).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from transport import Addresses, Requester, ResponderGone, TransportError, new_context

from ._store_wire import (
    MAX_FRAME_BYTES,
    MAX_VALUE_BYTES,
    Op,
    Status,
    encode_request,
    pack_delta,
    parse_reply,
)

#: How much longer than a request's timeout a client waits for the answer: the server answers
#: a `get` or `wait` whose keys did not come at that timeout, and its answer says so.
ANSWER_GRACE_S = 0.5

_context: Any = None
_context_lock = threading.Lock()


def _shared_context() -> Any:
    """This process's zmq context for store connections (made at first use)."""
    global _context
    with _context_lock:
        if _context is None:
            _context = new_context()
        return _context


class _Connections:
    """One `Requester` per calling thread, closed when its thread ends, or all together.

    zmq sockets are not thread-safe: a socket is closed only while no call uses it. `close`
    from any thread closes the idle ones at once; one in a call is closed by its own thread
    when that call ends (it ends within its timeout, as every call does)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._local = threading.local()
        self._all: set[Requester] = set()
        self._busy: set[Requester] = set()
        self._lock = threading.RLock()  # (a thread's end may come while it holds it)
        self._closed = False

    @contextlib.contextmanager
    def mine(self) -> Iterator[Requester]:
        """This thread's connection, for one call (opened at its first)."""
        with self._lock:
            if self._closed:
                raise dist.DistNetworkError(  # type: ignore[attr-defined]
                    f"the connection to the store at {self.address} is closed: "
                    "open a new StoreClient"
                )
            requester: Requester | None = getattr(self._local, "requester", None)
            if requester is None:
                requester = Requester(_shared_context(), self.address, max_bytes=MAX_FRAME_BYTES)
                self._all.add(requester)
                self._local.requester = requester
                self._local.end = _ThreadEnd(self, requester)
            self._busy.add(requester)
        try:
            yield requester
        finally:
            with self._lock:
                self._busy.discard(requester)
                closing = self._closed
            if closing:  # closed by another thread during the call
                self.release(requester)

    def release(self, requester: Requester) -> None:
        """Close the connection of a thread that ended (or whose call ended after `close`)."""
        with self._lock:
            if requester not in self._all or requester in self._busy:
                return
            self._all.discard(requester)
        requester.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = self._all - self._busy
            self._all -= idle
        for requester in idle:
            requester.close()


class _ThreadEnd:
    """Held in a thread's local data, which goes when the thread ends: closes its connection
    then (a process whose calls come from ever new threads keeps no sockets of dead ones)."""

    def __init__(self, connections: _Connections, requester: Requester) -> None:
        self._connections = connections
        self._requester = requester

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (at the interpreter's exit, say)
            self._connections.release(self._requester)


class StoreClient(dist.Store):  # type: ignore[misc,name-defined]
    """A connection of this process to the store at `addresses` (see the module docstring)."""

    def __init__(self, addresses: Addresses, timeout_s: float) -> None:
        super().__init__()
        self.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.addresses = addresses
        self._connections = _Connections(addresses.reachable_here())
        self._ids = itertools.count(1)
        self._closer = weakref.finalize(self, self._connections.close)

    def close(self) -> None:
        """Close this process's connections to the store (every thread's; any thread may):
        the idle ones now, one in a call when that call ends."""
        self._closer()

    def set(self, key: str, value: str | bytes) -> None:
        self._ask(Op.SET, [_bytes(key), _bytes(value)])

    def get(self, key: str) -> bytes:
        """The value of `key`, once it is set (within the store's timeout)."""
        return self._ask(Op.GET, [_bytes(key)])[0]

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Return once every key of `keys` is set (within `timeout`, else the store's)."""
        self._ask(Op.WAIT, [_bytes(key) for key in keys], timeout)

    def add(self, key: str, value: int) -> int:
        return int(self._ask(Op.ADD, [_bytes(key), pack_delta(value)])[0])

    def check(self, keys: list[str]) -> bool:
        return self._ask(Op.CHECK, [_bytes(key) for key in keys])[0] == b"1"

    def delete_key(self, key: str) -> bool:
        return self._ask(Op.DELETE, [_bytes(key)])[0] == b"1"

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._ask(Op.COMPARE_SET, [_bytes(key), _bytes(expected), _bytes(desired)])[0]

    def delete_prefixes(self, prefixes: list[str]) -> int:
        """Delete every key that starts with one of `prefixes` (not c10d's: the group's own
        clean-up, see `_aborts.QuorumKeys`); how many keys went."""
        return int(self._ask(Op.DELETE_PREFIXES, [_bytes(prefix) for prefix in prefixes])[0])

    def num_keys(self) -> int:
        return int(self._ask(Op.NUM_KEYS, [])[0])

    def clone(self) -> StoreClient:
        return StoreClient(self.addresses, self.timeout.total_seconds())

    def _ask(
        self, op: Op, args: list[bytes], timeout: datetime.timedelta | None = None
    ) -> list[bytes]:
        """Send one request and wait for its answer, all within the timeout."""
        _check_sizes(op, args)
        # a zero timeout is torch's "no timeout": the store's then (every call ends)
        timeout_ms = int((timeout or self.timeout).total_seconds() * 1000)
        request_id = next(self._ids)
        try:
            with self._connections.mine() as requester:
                return self._exchange(requester, op, request_id, timeout_ms, args)
        except ResponderGone as exc:
            raise dist.DistNetworkError(  # type: ignore[attr-defined]
                f"the replica group's store went away during {op.name}: {exc}"
            ) from exc
        except TransportError as exc:
            raise dist.DistNetworkError(  # type: ignore[attr-defined]
                f"the store request {op.name} failed: {exc}"
            ) from exc

    @staticmethod
    def _exchange(
        requester: Requester, op: Op, request_id: int, timeout_ms: int, args: list[bytes]
    ) -> list[bytes]:
        deadline = time.monotonic() + timeout_ms / 1000 + ANSWER_GRACE_S
        request = encode_request(op, request_id, timeout_ms, args)
        if not requester.send(request, timeout_ms):
            raise dist.DistNetworkError(  # type: ignore[attr-defined]
                f"could not connect to the replica group's store at {requester.address} "
                f"within {timeout_ms} ms: is its controller still running?"
            )
        while True:
            try:
                return _answer(requester, request_id, deadline, op)
            except ResponderGone as gone:
                again = encode_request(op, request_id, timeout_ms, args, resent=True)
                _send_again(requester, again, deadline, gone)


def _send_again(
    requester: Requester, request: list[bytes], deadline: float, gone: ResponderGone
) -> None:
    """The connection closed with `request` in flight (a pause of either side past the
    heartbeat timeout, say): connect again and send it again, same id, before `deadline`.
    The store applies it at most once (`_store_replies`). Raises `gone` if the store does
    not take a connection in time, or nothing listens there any more."""
    left_ms = int((deadline - time.monotonic()) * 1000)
    if left_ms <= 0 or not requester.reconnect(left_ms) or not requester.send(request, 0):
        raise gone


def _answer(requester: Requester, request_id: int, deadline: float, op: Op) -> list[bytes]:
    """The answer to request `request_id` by `deadline` (answers to requests given up
    before, which may still come, are skipped)."""
    while (left := deadline - time.monotonic()) > 0:
        frames = requester.receive(int(left * 1000) + 1)
        if frames is None:
            break
        answered, status, answer = parse_reply(frames)
        if answered != request_id:
            continue
        if status == Status.OK:
            return answer
        reason = answer[0].decode(errors="replace") if answer else "no reason given"
        if status in (Status.TIMEOUT, Status.FORGOTTEN):
            raise dist.DistStoreError(reason)  # type: ignore[attr-defined]
        raise ValueError(f"the replica group's store refused {op.name}: {reason}")
    raise dist.DistStoreError(  # type: ignore[attr-defined]
        f"the replica group's store at {requester.address} did not answer {op.name} in "
        "time: its controller may be stuck or gone"
    )


def _check_sizes(op: Op, args: list[bytes]) -> None:
    """Refuse here what the server would refuse (a frame too large would cost the connection)."""
    if any(len(arg) > MAX_VALUE_BYTES for arg in args):
        raise ValueError(
            f"{op.name}: a value is larger than the store allows ({MAX_VALUE_BYTES} bytes); "
            "pass large data through the transport, not the store"
        )


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
