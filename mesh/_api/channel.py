"""Channels: ``Channel.open()`` gives a `Port` (send from anywhere) and its `PortReceiver`.

Monarch's names and calls. Messages from one sender arrive in the order it sent them; the
receiver holds at most `bound` of them (more are dropped, and ``recv()`` then says so). What
happens on failure, and what can be known of it:

- sending to a port whose receiver's proc is gone raises `SupervisionError` (the sender
  watches that proc from the moment it unpickled the port; a message sent while the proc dies
  is lost). A receiver in the client needs no watch: the client's end stops every proc.
- ``recv()`` on an empty port fails with `SupervisionError` once every proc that unpickled a
  copy of the port is gone (a receiver cannot know of copies that never left its process).
  Each process that unpickles a copy tells the receiver, so a port forwarded from proc to proc
  counts every holder; a holder that dies before its copy's news arrives can make the
  receiver give up early, so forward a port before its first holder may end.
- sends to a closed receiver (``close()``, or dropped) are dropped, logged at the receiver.
- a receiver that begins to listen on tcp (an ``attach``) tells the holders of its ports, so
  that a copy they pass on reaches it from another host; a copy that still holds only an ipc
  address (passed on before that news arrived) raises `TransportError` on another host,
  saying so.
"""

from __future__ import annotations

import os
from typing import Any, Generic, TypeVar

from mesh._context import context
from mesh._engine.future import Future
from mesh._engine.messages import PortHeld, PortMessage
from mesh._engine.ports import DEFAULT_PORT_BOUND, PortQueue, watch_proc
from mesh._engine.runtime import Runtime
from mesh._engine.session import current_session
from supervision import SupervisionError
from transport import Addresses, Payload, TransportError, encode

R = TypeVar("R")


class Port(Generic[R]):
    """The sending end of a channel: picklable, so it can go to actors inside messages."""

    __slots__ = ("_address", "_addresses", "_agent", "_port_id", "_proc_id", "_stranded")

    def __init__(self, addresses: Addresses, port_id: int, proc_id: str, agent: str | None) -> None:
        self._addresses = addresses  # the receiver's: ipc for holders on its host, else tcp
        self._address = addresses.reachable_here()
        # only an ipc address, and not on this host: no message could arrive
        self._stranded = addresses.tcp is None and not os.path.exists(
            self._address.removeprefix("ipc://")
        )
        self._port_id = port_id
        self._proc_id = proc_id  # the receiver's process
        self._agent = agent  # its host agent, None for a client

    def send(self, value: R) -> None:
        """Send `value` to the receiver without waiting (raises `SupervisionError` when the
        receiver's proc is known to be gone, and what pickling raises)."""
        self._send("value", value)

    def exception(self, error: BaseException) -> None:
        """Send `error`: the receiver's ``recv()`` raises it."""
        if not isinstance(error, BaseException):
            raise TypeError(f"Port.exception() needs an exception, got {error!r}")
        self._send("exception", error)

    def _send(self, kind: str, value: Any) -> None:
        runtime = current_session().runtime
        receiver = runtime.ownership.peer(self._proc_id) if self._agent is not None else None
        if receiver is not None and not receiver.alive:
            assert receiver.event is not None
            raise SupervisionError(
                receiver.event,
                f"cannot send to port {self._port_id}: its receiver's proc is gone: ",
            )
        if self._stranded:
            raise TransportError(_stranded(self))
        point = context().rank
        rank = point.rank if point.extent.labels else -1
        header = PortMessage(self._port_id, rank, kind)
        runtime.send_frames(self._address, PortMessage, encode(header, Payload.dump(value)))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled in its receiver's process, a port carries the addresses that process has
        now: it may listen on tcp since the port was opened (an `attach` after
        ``Channel.open()``), and a holder on another host cannot use its ipc address."""
        addresses = self._addresses
        runtime = current_session().runtime
        if runtime.proc_id == self._proc_id:
            addresses = runtime.addresses
        else:  # a holder: its receiver may have announced tcp since (`ReceiverAddresses`)
            addresses = runtime.ports.addresses_of(self._proc_id, addresses)
        return _rebuild_port, (addresses, self._port_id, self._proc_id, self._agent)

    def __repr__(self) -> str:
        return f"<Port {self._port_id} of {self._proc_id}>"


def _stranded(port: Port[Any]) -> str:
    """Why `port` cannot send from here, and what to do."""
    return (
        f"cannot send to port {port._port_id} of {port._proc_id}: the port holds only its "
        f"receiver's ipc address ({port._address}), which is not on this host. It was passed "
        "on by a process that got it before its receiver listened on tcp (or its receiver is "
        "gone); send the port from its receiver's process again, or open the channel once "
        "that process has attached to other hosts."
    )


def _rebuild_port(addresses: Addresses, port_id: int, proc_id: str, agent: str | None) -> Port[Any]:
    """A copy of a port arrived here: tell its receiver (a new holder), and watch its proc."""
    runtime = current_session().runtime
    port: Port[Any] = Port(addresses, port_id, proc_id, agent)
    address = port._address
    if runtime.proc_id != proc_id:
        if agent is not None:
            watch_proc(runtime, proc_id, agent, address)
        held = PortHeld(port_id, runtime.proc_id, runtime.agent or "", runtime.address_for(address))
        runtime.send_message(address, held)
    return port


class PortReceiver(Generic[R]):
    """The receiving end of a channel, in the process that opened it (not picklable)."""

    def __init__(self, runtime: Runtime, queue: PortQueue) -> None:
        self._runtime = runtime
        self._queue = queue

    def recv(self) -> Future[R]:
        """The next message, in arrival order: ``.get()`` or ``await`` it. It raises what the
        sender passed to ``Port.exception``, or why nothing more can come (see the module)."""
        return self._queue.recv()

    def close(self) -> None:
        """Stop receiving: later messages are dropped, waiting ``recv()`` calls fail."""
        self._runtime.ports.close(self._queue.port_id)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # the session may be gone already (interpreter shutdown)
            pass

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError(
            "a PortReceiver cannot leave the process that opened its channel; send the Port "
            "instead, and receive here."
        )

    def __repr__(self) -> str:
        return f"<PortReceiver of port {self._queue.port_id}>"


class Channel(Generic[R]):
    """Opens channels: ``port, receiver = Channel[int].open()``."""

    @staticmethod
    def open(
        once: bool = False, *, bound: int = DEFAULT_PORT_BOUND
    ) -> tuple[Port[R], PortReceiver[R]]:
        """A new port and its receiver, here. `once`: only the first message is kept.
        `bound`: how many messages may wait for ``recv()`` (meshvisor's addition)."""
        if type(bound) is not int or bound < 1:
            raise ValueError(f"Channel.open() needs a bound of at least 1 (an int), got {bound!r}")
        runtime = current_session().runtime
        queue = runtime.ports.open(bound, once)
        port: Port[R] = Port(runtime.addresses, queue.port_id, runtime.proc_id, runtime.agent)
        return port, PortReceiver(runtime, queue)
