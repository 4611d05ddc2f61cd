"""`Addresses`: where one inbox listens, and which of its addresses to hand to a given peer.

An inbox listens on ipc (a socket file in a private directory: this host, this user, no keys
needed) and, once its process reaches hosts over the network, on tcp too (CURVE-authenticated:
only holders of the allocation's keys get in). A peer that can use the ipc address must be
given it: a keyless process on this host (a daemon agent's proc started apart from the
allocation) cannot authenticate to the tcp one, and its messages would be lost. This is the
one place that choice is made (`nearest_for`); a sender that holds the whole set (a channel's
port, which goes anywhere) takes the ipc address when it is on this host (`reachable_here`).
`is_address` is the one check of an address that arrives in a message.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

from ._errors import TransportError

_IPC = "ipc://"


@dataclass(frozen=True, slots=True)
class Addresses:
    """The ipc and tcp addresses of one inbox (either may be missing, not both)."""

    ipc: str | None
    tcp: str | None = None

    @classmethod
    def of(cls, address: str) -> Addresses:
        """The set holding the one address an inbox was bound at."""
        return cls(address, None) if address.startswith(_IPC) else cls(None, address)

    def with_tcp(self, tcp: str) -> Addresses:
        """This set, also listening on tcp at `tcp`."""
        return Addresses(self.ipc, tcp)

    @property
    def widest(self) -> str:
        """The address that most peers can reach (tcp when there is one): for a receiver
        that is not known when the address is handed out."""
        address = self.tcp or self.ipc
        assert address is not None
        return address

    def nearest_for(self, peer: str | None) -> str:
        """The address to hand to the process at `peer` (its own address, or its host
        agent's; None: not known): ipc when `peer` is an ipc address (it is on this host,
        and a peer that needs no keys must not be asked for them), else the widest."""
        if self.ipc is not None and (self.tcp is None or (peer or "").startswith(_IPC)):
            return self.ipc
        return self.widest

    def reachable_here(self) -> str:
        """The address for a sender that was handed the whole set (a `Port` that travelled):
        ipc when its socket file is on this host (a private directory of this user), else
        the widest. One look at the file system, when the sender takes the set up."""
        if self.ipc is not None and os.path.exists(self.ipc[len(_IPC) :]):
            return self.ipc
        return self.widest

    def __iter__(self) -> Iterator[str]:
        """Each address of the set."""
        return iter(address for address in (self.ipc, self.tcp) if address is not None)


def host_towards(address: str) -> str:
    """The IPv4 address of this host's interface that the kernel routes to tcp `address`
    (loopback for a peer on loopback): where to listen so that a peer there can answer.
    Nothing is sent (a UDP socket's connect only picks the route); loopback when no route."""
    host = address.removeprefix("tcp://").rsplit(":", 1)[0]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            found: str = probe.getsockname()[0]
    except (OSError, UnicodeError):  # no route, an IPv6 or unresolvable host
        return "127.0.0.1"
    return found


#: The schemes of the zmq endpoints meshvisor sends to.
_ADDRESS_SCHEMES = ("ipc://", "tcp://", "inproc://")


#: Longer than any ipc path or tcp endpoint: a longer "address" is garbage from a peer.
_MAX_ADDRESS_LEN = 4096


def is_address(value: object) -> bool:
    """Whether `value` can be a meshvisor address (``ipc://PATH``, ``tcp://HOST:PORT``): the
    one check for addresses that arrive in messages, before anything acts on them."""
    return (
        type(value) is str and value.startswith(_ADDRESS_SCHEMES) and len(value) <= _MAX_ADDRESS_LEN
    )


def check_address(address: object) -> None:
    """Refuse what is not an address (a malformed header can carry anything) before a
    socket is made for it."""
    if not is_address(address):
        raise TransportError(
            f"cannot send to {address!r}: not a meshvisor address (a string such as "
            "ipc://PATH or tcp://HOST:PORT); the message that named it is malformed."
        )
