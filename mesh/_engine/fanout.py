"""Which messages of a call go straight to their procs, and which once to each host agent.

A call to several actors of one host is sent once, to that host's agent, which delivers it
to each proc and sends their answers back in batches (`FanOut`, `RelayedReplies`). So the
caller's work per call grows with the number of hosts, not of actors.

Per-pair FIFO between this process and each actor holds across the two paths: the messages
to one actor keep the path of the previous one until every message sent on it is known to
have arrived (an answer to a message proves that it and all before it on its path arrived),
and only then may take the other path. A message can therefore never overtake an earlier one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mesh._engine.calls import PendingCall
from mesh._engine.fanout_messages import FanOut
from mesh._engine.messages import CallActor, StopActor
from mesh._engine.peers import ProcPeer, Route
from mesh._engine.shared_payload import SHARED_PAYLOAD_MIN_BYTES
from mesh._settings import current_settings
from transport import Payload, encode, network_faults

_RELAYABLE = (CallActor, StopActor)
_FAULTS = network_faults()


@dataclass
class Routed:
    """The messages of one call by path. `sequence`: for each rank in the call whose answer
    is awaited, its actor's route and its message's number on it (see `answered`)."""

    direct: list[tuple[ProcPeer, Any]] = field(default_factory=list)
    relayed: dict[str, list[tuple[ProcPeer, Any]]] = field(default_factory=dict)
    sequence: dict[int, tuple[Route, int]] = field(default_factory=dict)


def route(
    messages: list[tuple[ProcPeer, Any]], answered: bool, payload: Payload | None = None
) -> Routed:
    """Choose each message's path (caller holds the ownership lock); `answered`: whether
    answers to these messages are awaited (then `Routed.sequence` is filled); `payload`:
    theirs, a large one fans out from fewer recipients (the agent shares it)."""
    routed = Routed()
    fanned = _hosts_worth_fanning_out(messages, answered, payload)
    for peer, header in messages:
        actor_id = getattr(header, "actor_id", None)
        if actor_id is None:  # no actor's mailbox: no order to keep
            routed.direct.append((peer, header))
            continue
        path = peer.routes.get(actor_id)
        if path is None:
            path = peer.routes[actor_id] = Route()
        relayable = type(header) in _RELAYABLE
        # `path.settled`, inlined: once per recipient (not relayable: a re-spawn starts a new
        # actor, with no order to keep)
        if path.seen == path.sent or not relayable:
            path.via_agent = relayable and peer.agent in fanned
        path.sent += 1
        if answered:
            routed.sequence[header.rank] = (path, path.sent)
        if path.via_agent:
            routed.relayed.setdefault(peer.agent, []).append((peer, header))  # type: ignore[arg-type]
        else:
            routed.direct.append((peer, header))
    return routed


def direct_route(peer: ProcPeer, actor_id: str) -> Route | None:
    """The route of a call to one actor on `peer` (a ready proc; lock held) when `route` would
    send it straight to the proc: counted as sent. None when it might go through the host
    agent (an earlier message did and is not known to have arrived, or a call to one actor is
    fanned out): then `route` decides."""
    path = peer.routes.get(actor_id)
    if path is None:
        path = peer.routes[actor_id] = Route()
    if path.seen == path.sent:  # `path.settled`, inlined: once per call
        if peer.agent is not None and current_settings().fanout_min_recipients <= 1:
            return None
        path.via_agent = False
    elif path.via_agent:
        return None
    path.sent += 1
    return path


def note_answer(pending: PendingCall, rank: int) -> None:
    """Rank `rank` of `pending` answered: its message, and those before it on its path,
    arrived."""
    if pending.sequence:
        found = pending.sequence.pop(rank, None)
        if found is not None and found[1] > found[0].seen:
            found[0].seen = found[1]


def fan_out_frames(group: list[tuple[ProcPeer, Any]], payload: Payload | None) -> list[Any]:
    """The one message to a host agent that delivers the headers of `group` (one call). The
    first header stands for all: the procs of one agent are all ipc or all tcp, so each was
    handed the same reply address (`Runtime.address_for`)."""
    proc_ids = tuple([peer.proc_id for peer, _ in group])
    ranks = tuple([header.rank for _, header in group])
    return encode(FanOut(group[0][1], proc_ids, ranks), payload)


def _hosts_worth_fanning_out(
    messages: list[tuple[ProcPeer, Any]], answered: bool, payload: Payload | None
) -> set[str]:
    """The agents with at least `Settings.fanout_min_recipients` ready recipients of these
    messages (`fanout_min_shared_recipients` for a payload the agents share). None while this
    process's sends go through fault rules: chaos rules name the procs' addresses."""
    settings = current_settings()
    least = settings.fanout_min_recipients
    shared_least = min(least, settings.fanout_min_shared_recipients)
    if shared_least <= len(messages) < least and _shared_by_agents(answered, payload):
        least = shared_least
    if _FAULTS.active or len(messages) < least:
        return set()
    count: dict[str, int] = {}
    for peer, header in messages:
        if peer.agent is not None and peer.address is not None and type(header) in _RELAYABLE:
            count[peer.agent] = count.get(peer.agent, 0) + 1
    return {agent for agent, n in count.items() if n >= least}


def _shared_by_agents(answered: bool, payload: Payload | None) -> bool:
    """Whether a host agent would share `payload` among its procs rather than copy it to
    each (`mesh/_agent/shared_segments.py`): large, and answers awaited."""
    return answered and payload is not None and payload.nbytes >= SHARED_PAYLOAD_MIN_BYTES
