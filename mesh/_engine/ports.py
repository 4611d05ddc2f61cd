"""`PortTable`: the receiving ends of the ports opened in this process, fed by the event loop.

A port's messages come to its process's main inbox (`PortMessage`) and wait, in arrival order,
in the port's bounded queue until ``recv()`` takes them. Each process that unpickles a copy of
the port tells the receiver (`PortHeld`); the receiver watches those procs, so that once every
one of them is gone and the queue is empty, ``recv()`` fails instead of waiting forever.
A receiver that begins to listen on tcp tells its holders (`ReceiverAddresses`: at once, or
in answer to a later `PortHeld`), so that a copy they pass on carries its tcp address too.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Any, Protocol

from mesh._engine.future import Future, LoopPump
from mesh._engine.messages import (
    PortHeld,
    PortMessage,
    ReceiverAddresses,
    WatchProcs,
    invalid_fields,
    invalid_request,
)
from mesh._engine.ownership import Ownership
from mesh._engine.peers import ProcPeer
from mesh._shape import Extent, Point
from supervision import SupervisionError
from transport import Addresses, Envelope, get_logger


class PortHost(LoopPump, Protocol):
    """What ports need of their process's runtime: its loop (for futures), its registry of
    procs (to watch holders) and sending."""

    @property
    def proc_id(self) -> str: ...

    @property
    def addresses(self) -> Addresses: ...

    def address_for(self, peer: str | None, home: Any = None) -> str:
        """This process's address to hand to the process at `peer` (`Runtime.address_for`)."""
        ...

    @property
    def ownership(self) -> Ownership: ...

    def send_message(self, address: str, header: Any, payload: Any = None) -> None: ...


#: How many messages a port's receiver holds when nobody asks for them, by default.
DEFAULT_PORT_BOUND = 10_000
_NO_POINT = Point((), Extent((), ()))


class PortQueue:
    """One port's receiving end: messages not taken yet, the ``recv()`` futures waiting for
    one, and the procs holding a copy of the port. `lock` guards all of it."""

    def __init__(self, runtime: PortHost, port_id: int, bound: int, once: bool) -> None:
        self.runtime = runtime
        self.port_id = port_id
        self.bound = bound
        self.once = once
        self.items: deque[tuple[str, Any]] = deque()
        self.waiters: deque[Future[Any]] = deque()
        self.holders: dict[str, ProcPeer | None] = {}  # None: a holder that cannot be watched
        self.dropped = 0
        self.received = 0
        self.closed = False
        self.lock = threading.Lock()

    def put(self, kind: str, value: Any) -> None:
        """A message arrived (loop thread): to the oldest waiter, else to the queue."""
        with self.lock:
            if self.closed or (self.once and self.received):
                self.dropped += 1
                return
            self.received += 1
            waiter = self.waiters.popleft() if self.waiters else None
            if waiter is None:
                if len(self.items) >= self.bound:
                    self.dropped += 1
                    return
                self.items.append((kind, value))
        if waiter is not None:
            _settle(waiter, kind, value)

    def recv(self) -> Future[Any]:
        """A future of the next message (its value, or the exception sent)."""
        future: Future[Any] = Future(self.runtime, f"recv() of port {self.port_id}")
        with self.lock:
            found = self.items.popleft() if self.items else None
            error = None if found is not None else self._why_nothing_comes()
            if found is None and error is None:
                self.waiters.append(future)
                return future
        if found is not None:
            _settle(future, *found)
        else:
            assert error is not None
            future.set_exception(error)
        return future

    def _why_nothing_comes(self) -> BaseException | None:
        """Why no message can come any more (lock held), or None while one still may."""
        if self.once and self.received:
            return ValueError(
                f"port {self.port_id} is a once port and delivered its message already"
                + (f" ({self.dropped} later one(s) were dropped)" if self.dropped else "")
                + "; open it without once=True to receive several."
            )
        if self.dropped:
            why = "its queue was full"
            return OverflowError(
                f"port {self.port_id}: {self.dropped} message(s) were dropped because {why} "
                f"(bound {self.bound}); take messages with recv() sooner, or open the "
                "channel with a larger bound."
            )
        if self.closed:
            return ValueError(f"port {self.port_id}: its receiver was closed.")
        holders = list(self.holders.values())
        if holders and all(peer is not None and peer.finished for peer in holders):
            last = holders[-1]
            assert last is not None and last.event is not None
            names = ", ".join(sorted(self.holders))
            return SupervisionError(
                last.event,
                f"port {self.port_id}: every process holding it is gone ({names}), so "
                "nothing more can be sent to it: ",
            )
        return None

    def wake_if_stuck(self) -> None:
        """Fail the waiters when no message can come any more (a holder's proc is gone)."""
        with self.lock:
            error = None if self.items else self._why_nothing_comes()
            waiters = list(self.waiters) if error is not None else []
            if error is not None:
                self.waiters.clear()
        for waiter in waiters:
            waiter.set_exception(error)  # type: ignore[arg-type]

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self.wake_if_stuck()


def _settle(future: Future[Any], kind: str, value: Any) -> None:
    if kind == "exception" and isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


class PortTable:
    """The ports whose receiver lives in this process, by id."""

    def __init__(self, runtime: PortHost) -> None:
        self._runtime = runtime
        self._ports: dict[int, PortQueue] = {}
        self._ids = itertools.count(1)
        self._log = get_logger("mesh.ports", proc=runtime.proc_id)
        self._lock = threading.Lock()
        self._holders: dict[str, str] = {}  # holder proc id -> its address, of every port
        self._told: set[str] = set()  # holders told this process's tcp address
        self._newer: dict[str, Addresses] = {}  # receivers' addresses learned since their ports

    def open(self, bound: int, once: bool) -> PortQueue:
        queue = PortQueue(self._runtime, next(self._ids), bound, once)
        self._ports[queue.port_id] = queue
        return queue

    def close(self, port_id: int) -> None:
        queue = self._ports.pop(port_id, None)
        if queue is not None:
            queue.close()

    def on_message(self, envelope: Envelope) -> None:
        header: PortMessage = envelope.header
        queue = self._known(header, header.port_id)
        if queue is None:
            return
        try:
            value = envelope.payload.load()  # type: ignore[union-attr]
        except Exception as exc:  # the receiver learns of it: the message did not vanish
            queue.put("exception", _unloadable(header, exc))
            return
        queue.put("exception" if header.kind == "exception" else "value", value)

    def on_held(self, envelope: Envelope) -> None:
        """A proc unpickled a copy of the port: watch it (loop thread)."""
        header: PortHeld = envelope.header
        queue = self._known(header, header.port_id)
        if queue is None:
            return
        peer = None
        if header.agent:  # a proc: its agent tells when it ends (a client's end ends all)
            peer = watch_proc(self._runtime, header.proc_id, header.agent, header.address)
        with queue.lock:
            queue.holders[header.proc_id] = peer
        if peer is not None:
            peer.gone.add_done_callback(lambda _: queue.wake_if_stuck())
        with self._lock:  # after `listens_on_tcp` told the others: tell this one
            self._holders[header.proc_id] = header.address
            tell = self._runtime.addresses.tcp is not None and header.proc_id not in self._told
            if tell:
                self._told.add(header.proc_id)
        if tell:
            self._tell_addresses([header.address])

    def listens_on_tcp(self) -> None:
        """This process listens on tcp now (any thread): the holders of its ports got them
        with its ipc address only; each is told the new set, once."""
        with self._lock:
            told = [(p, a) for p, a in self._holders.items() if p not in self._told]
            self._told.update(proc_id for proc_id, _ in told)
        self._tell_addresses([address for _, address in told])

    def _tell_addresses(self, holders: list[str]) -> None:
        runtime = self._runtime
        ipc, tcp = runtime.addresses.ipc or "", runtime.addresses.tcp or ""
        for address in holders:
            runtime.send_message(address, ReceiverAddresses(runtime.proc_id, ipc, tcp))

    def on_receiver_addresses(self, envelope: Envelope) -> None:
        """The receiver of ports held here listens at more addresses now (any thread)."""
        header: ReceiverAddresses = envelope.header
        reason = invalid_request(header)
        if reason is not None or not (header.ipc or header.tcp):
            why = reason or "no address"
            self._log.warning("message_rejected", kind="ReceiverAddresses", reason=why)
            return
        with self._lock:
            self._newer[header.proc_id] = Addresses(header.ipc or None, header.tcp or None)

    def addresses_of(self, proc_id: str, known: Addresses) -> Addresses:
        """The addresses of the receiver `proc_id` to pass its ports on with: `known` (what
        a port held here carries), or newer ones it announced since."""
        return self._newer.get(proc_id, known)

    def _known(self, header: Any, port_id: int) -> PortQueue | None:
        reason = invalid_fields(header)
        queue = None if reason is not None else self._ports.get(port_id)
        if queue is None:
            why = reason or "no open receiver has this port id (closed, or never opened here)"
            self._log.warning("port_message_dropped", kind=type(header).__name__, reason=why)
        return queue


def watch_proc(runtime: PortHost, proc_id: str, agent: str, address: str) -> ProcPeer:
    """The peer of proc `proc_id`; one not known here yet is watched through its agent."""
    peer = runtime.ownership.peer(proc_id)
    if peer is None:
        peer = runtime.ownership.add_peer(ProcPeer(proc_id, proc_id, _NO_POINT, agent, address))
        runtime.send_message(agent, WatchProcs((proc_id,), runtime.address_for(agent)))
    return peer


def _unloadable(header: PortMessage, error: Exception) -> Exception:
    return ValueError(
        f"a message (from rank {header.rank}) for port {header.port_id} could not be "
        f"unpickled here: {error!r}"
    )
