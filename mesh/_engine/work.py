"""`Work`: a message for an actor, classified once when it arrives in the proc.

The runtime's table of handlers picks the `ActorHost` entry by message type (the one switch on
type); the entry builds the `Work`, and what follows (which lane runs it, what runs, what answers
the caller) reads its `kind` and the built-in handler chosen in `call_work`.
"""

from __future__ import annotations

import functools
from typing import Any, Generic, Literal, NamedTuple, TypeVar

from mesh._engine.builtins import BUILTINS, Builtin
from mesh._engine.messages import CallActor, SpawnActor, StopActor
from transport import Envelope, Payload

H = TypeVar("H", bound=SpawnActor | CallActor | StopActor)


#: What a message asks of an actor: "construct" it (SpawnActor), run one of its user endpoints
#: ("call", CallActor; "lone" when it came as a lone call: `lone_calls`) or an endpoint every
#: actor has ("builtin", from `BUILTINS`), or "stop" it after what is queued before
#: (StopActor). Plain strings: read once or twice per message.
Kind = Literal["construct", "call", "lone", "builtin", "stop"]

#: The kinds that answer a caller with the outcome of an endpoint.
CALL_KINDS: frozenset[Kind] = frozenset({"call", "lone", "builtin"})


class Work(NamedTuple, Generic[H]):
    """One message for an actor and what it asks: `builtin` is the handler of a built-in call.
    Immutable: a named tuple, which builds in half the time of a frozen dataclass (one is made
    per message)."""

    kind: Kind
    header: H
    payload: Payload | None
    builtin: Builtin | None = None
    #: The `lone_calls.Route` of a "lone" call (sync, neither concurrent nor with a port).
    route: Any = None

    def arguments(self) -> Any:
        """The message's payload, unpickled (raises what unpickling raises)."""
        if self.payload is None:
            raise ValueError(f"the {self.kind} message came without its arguments")
        return self.payload.load()


def call_work(envelope: Envelope) -> Work[CallActor]:
    """A call: to one of the actor's user endpoints, or to a built-in one (by its name)."""
    header: CallActor = envelope.header
    builtin = BUILTINS.get(header.endpoint)
    if builtin is None:
        return new_work(("call", header, envelope.payload, None, None))  # type: ignore[no-any-return]
    return Work("builtin", header, envelope.payload, builtin)


#: `Work` from its five fields in a tuple, without the named tuple's Python `__new__` (one is
#: made per call: a C call, no Python frame).
new_work = functools.partial(tuple.__new__, Work)
