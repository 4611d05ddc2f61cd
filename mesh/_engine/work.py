"""`Work`: a message for an actor, classified once when it arrives in the proc.

The proc switches on the message type here and nowhere else: what follows (which lane runs it,
what runs, what answers the caller) reads the `kind` and the built-in handler chosen here.
"""

from __future__ import annotations

import enum
from typing import Any, Generic, NamedTuple, TypeVar

from mesh._engine.builtins import BUILTINS, Builtin
from mesh._engine.messages import CallActor, SpawnActor, StopActor
from transport import Envelope, Payload

H = TypeVar("H", bound=SpawnActor | CallActor | StopActor)


class Kind(enum.StrEnum):
    """What a message asks of an actor (a str enum: it keys the runner tables, and a str hashes
    faster than a plain enum member, once per message)."""

    CONSTRUCT = "construct"  # build the actor (SpawnActor)
    CALL = "call"  # run one of its user endpoints (CallActor)
    BUILTIN = "builtin"  # run an endpoint every actor has, from `BUILTINS` (CallActor)
    STOP = "stop"  # stop it after what is queued before (StopActor)


#: The kinds that answer a caller with the outcome of an endpoint.
CALL_KINDS = frozenset({Kind.CALL, Kind.BUILTIN})


class Work(NamedTuple, Generic[H]):
    """One message for an actor and what it asks: `builtin` is the handler of a built-in call.
    Immutable: a named tuple, which builds in half the time of a frozen dataclass (one is made
    per message)."""

    kind: Kind
    header: H
    payload: Payload | None
    builtin: Builtin | None = None

    def arguments(self) -> Any:
        """The message's payload, unpickled (raises what unpickling raises)."""
        if self.payload is None:
            raise ValueError(f"the {self.kind.value} message came without its arguments")
        return self.payload.load()


def classify(envelope: Envelope) -> Work[Any]:
    """The work `envelope` asks of its actor; a message of another type is a bug upstream."""
    header = envelope.header
    kind = type(header)
    if kind is CallActor:
        builtin = BUILTINS.get(header.endpoint)
        if builtin is None:
            return Work(Kind.CALL, header, envelope.payload)
        return Work(Kind.BUILTIN, header, envelope.payload, builtin)
    if kind is SpawnActor:
        return Work(Kind.CONSTRUCT, header, envelope.payload)
    if kind is StopActor:
        return Work(Kind.STOP, header, envelope.payload)
    raise TypeError(f"an actor cannot handle a {kind.__name__} message")
