"""What a `Manager` (in a replica's own training loop) and its `LoopGroup` (the controller) say.

Each request goes to the group's port with the port for its answer; the group answers every
request exactly once. Messages are frozen dataclasses, checked on arrival by `parse_request`.

- `AskQuorum`: the loop is at a step boundary and wants to train the next step. Answered with
  `HealFrom` (take the committed state of these peers first), `Go` (the step's process group),
  `Retry` (ask again) or `Finished` (the run is over for this loop).
- `Healed`: the heal that `HealFrom` asked for is done (or failed); answered like `AskQuorum`.
- `Vote`: the step's exchange succeeded here (or not); answered with the group's `Decision`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AskQuorum:
    replica: int
    incarnation: int
    step: int  # steps this loop has committed
    until: int  # the step its loop ends at


@dataclass(frozen=True)
class Healed:
    replica: int
    incarnation: int
    step: int  # the committed step it healed to
    ok: bool
    why: str = ""


@dataclass(frozen=True)
class Vote:
    replica: int
    incarnation: int
    quorum: int
    step: int
    ok: bool
    why: str = ""


@dataclass(frozen=True)
class HealFrom:
    step: int
    donors: tuple[Any, ...]  # the donors' loop runners: one-rank actor meshes


@dataclass(frozen=True)
class Go:
    quorum: int  # a new number whenever the members change: a new process group
    rank: int  # this loop's rank in the process group
    world: int
    step: int  # the step to train
    members: tuple[int, ...]


@dataclass(frozen=True)
class Retry:
    why: str


@dataclass(frozen=True)
class Finished:
    step: int


@dataclass(frozen=True)
class Decision:
    commit: bool
    why: str = ""


Request = AskQuorum | Healed | Vote
Answer = HealFrom | Go | Retry | Finished | Decision


@dataclass(frozen=True)
class Envelope:
    """A request on its way to the group: `seq` pairs it with its answer."""

    request: Request
    seq: int
    reply: Any  # the asking loop's Port


@dataclass(frozen=True)
class Reply:
    seq: int
    answer: Answer


def parse_request(message: Any, replicas: int) -> Envelope:
    """`message` as a request of one of `replicas` loops; ValueError saying what is wrong."""
    if not isinstance(message, Envelope) or not isinstance(message.request, Request):
        raise ValueError(f"a loop group got {type(message).__name__}, not a loop's request")
    replica = message.request.replica
    if type(replica) is not int or not 0 <= replica < replicas:
        raise ValueError(f"a loop group of {replicas} replicas got a request from {replica!r}")
    if not hasattr(message.reply, "send"):
        raise ValueError(f"replica {replica}'s request came with no port to answer on")
    for item in dataclasses.fields(message.request):
        value = getattr(message.request, item.name)
        if type(value).__name__ != item.type:
            raise ValueError(
                f"replica {replica}'s {type(message.request).__name__} has {item.name}="
                f"{value!r}, which is not of type {item.type}"
            )
    return message
