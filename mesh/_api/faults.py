"""Fault injection for chaos testing, through the public API: probe health, make an endpoint
raise, and drop or delay messages between parts of a job (the transport's fault hooks).

These are what the `chaos` package uses; they are public so that users can write their own
fault tests too. Nothing here changes a job that does not call it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from mesh._api.actor_mesh import ActorMesh
from mesh._api.endpoint import EndpointRef
from mesh._api.host_mesh import HostMesh
from mesh._engine.future import Future
from mesh._engine.messages import SetFaultRules
from mesh._engine.runtime import Runtime
from mesh._engine.session import current_session
from mesh._values import ValueMesh
from transport import FaultRule, network_faults

Party = ActorMesh[Any] | HostMesh | Literal["client"]


def probe(actors: ActorMesh[Any]) -> Future[ValueMesh[int]]:
    """Ask every actor of `actors` whether it runs; each answers its process id.

    A health probe for any actor class: it fails with `SupervisionError` where a rank has
    failed, and waits while a rank is being restarted.
    """
    ping: EndpointRef[[], int] = EndpointRef(actors, "__ping__")
    return ping.call()


def fail_next_call(
    actors: ActorMesh[Any], error: BaseException, endpoint: str | None = None
) -> Future[ValueMesh[None]]:
    """Make the next call to `endpoint` (any endpoint if None) of each actor raise `error`.

    An `Exception` fails only that call (the caller gets an `ActorError`); a `BaseException`
    that is not an `Exception` fails the actor, as a real one would.
    """
    install: EndpointRef[[str | None, BaseException], None] = EndpointRef(actors, "__fail_next__")
    return install.call(endpoint, error)


def exit_process(actors: ActorMesh[Any], code: int) -> None:
    """Make the procs of `actors` exit with status `code` at once, as a crash would (their
    owner sees an "exit" event; nothing is cleaned up)."""
    EndpointRef[[int], None](actors, "__exit_process__").broadcast(code)


@dataclass(frozen=True)
class _Process:
    """A process that can be told fault rules (None: this client) and where it receives."""

    address: str | None
    receives_at: frozenset[str]


def break_links(
    a: Party,
    b: Party | None = None,
    *,
    duration_s: float,
    probability: float = 0.0,
    delay_s: float = 0.0,
    hold: bool = False,
    seed: int = 0,
) -> None:
    """Drop (with `probability`) or delay (by `delay_s`) messages between `a` and `b`, both
    ways, for `duration_s` seconds; with `hold`, cut the links: messages wait until the
    `duration_s` is over, then go through in order. With `b` None, between `a` and every
    other process this client knows: ``break_links(host, hold=True, ...)`` partitions a host.

    Each process involved draws drops from its own generator seeded from `seed`, so the same
    traffic meets the same drops. The rules expire on their own.
    """
    if probability == 0.0 and delay_s == 0.0 and not hold:
        raise ValueError("break_links() needs a drop probability, a delay or hold=True")
    runtime = current_session().runtime
    left = _processes(runtime, a)
    right = _processes(runtime, b) if b is not None else _everything_else(runtime, left)
    if not left or not right:
        raise ValueError(f"break_links(): no process found for {a if not left else b!r}")
    label = f"{_describe(a)} <-> {_describe(b) if b is not None else 'the rest'}"
    plan: list[tuple[_Process, FaultRule]] = []
    for index, (senders, receivers) in enumerate(((left, right), (right, left))):
        to = frozenset().union(*(p.receives_at for p in receivers))
        for offset, sender in enumerate(senders):
            seed_here = seed * 7919 + index * 1009 + offset
            rule = FaultRule(to, duration_s, probability, delay_s, seed_here, label, hold)
            plan.append((sender, rule))
    local = [rule for sender, rule in plan if sender.address is None]
    for sender, rule in plan:  # remote ones first: our own rules could hold their messages
        if sender.address is not None:
            runtime.send_message(sender.address, SetFaultRules((rule,)))
    network_faults().install(local)


def heal_links() -> None:
    """Remove every fault rule, here and in every process this client knows."""
    runtime = current_session().runtime
    network_faults().clear()
    for process in _known(runtime):
        if process.address is not None:
            runtime.send_message(process.address, SetFaultRules((), clear=True))


def _processes(runtime: Runtime, party: Party) -> list[_Process]:
    if isinstance(party, str):
        if party != "client":
            raise ValueError(f"unknown party {party!r}: use 'client', an ActorMesh or a HostMesh")
        return [_client(runtime)]
    if isinstance(party, ActorMesh):
        return [_proc(peer.address) for peer in party._peers_in_region() if peer.address]
    agents = set(party._agent_addresses())
    procs = [
        _proc(peer.address)
        for peer in runtime.ownership.all_peers()
        if peer.agent in agents and peer.address and peer.alive
    ]
    return [_proc(agent) for agent in sorted(agents)] + procs


def _client(runtime: Runtime) -> _Process:
    addresses = {runtime.address, runtime.inbox.address, *runtime.replies.addresses()}
    return _Process(None, frozenset(addresses))


def _proc(address: str) -> _Process:
    return _Process(address, frozenset({address}))


def _known(runtime: Runtime) -> list[_Process]:
    """This client and every agent and live proc it knows."""
    agents = set(runtime.agents.attached_agents())
    procs = []
    for peer in runtime.ownership.all_peers():
        if peer.agent:
            agents.add(peer.agent)
        if peer.address and peer.alive:
            procs.append(_proc(peer.address))
    return [_client(runtime), *(_proc(a) for a in sorted(agents)), *procs]


def _everything_else(runtime: Runtime, party: Iterable[_Process]) -> list[_Process]:
    inside = {p.address for p in party}
    return [p for p in _known(runtime) if p.address not in inside]


def _describe(party: Party) -> str:
    if isinstance(party, str):
        return party
    return repr(party)
