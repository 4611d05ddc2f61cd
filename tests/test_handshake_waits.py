"""A proc's watch over answers sent to a caller whose handshake had not passed: when that
caller refuses this process's keys, every answer is reported, also past the number kept one by
one (then each owner is told once, for all the others): bounded, and no call left waiting.
Real sockets: a tcp listener holding other CURVE keys, and an outbox with the test's keys."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import zmq
from polling import wait_until

import transport
from mesh import Actor, context, endpoint
from mesh.testing import HandshakeWaits, RelayHandshakes, inbox_address, wire
from supervision import SupervisionError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def refusing_listener(tmp_path: Path) -> Iterator[tuple[transport.Outbox, str]]:
    """(an outbox, the address of a tcp listener that refuses its handshakes: other keys)."""
    others = transport.CurveKeys.create(str(tmp_path / "other-keys"))
    context = transport.new_context()
    server = context.socket(zmq.PULL)
    outbox = transport.Outbox(context)
    try:
        server.curve_server = True
        server.curve_secretkey, server.curve_publickey = others.secret, others.public
        port = server.bind_to_random_port("tcp://127.0.0.1")
        yield outbox, f"tcp://127.0.0.1:{port}"
    finally:
        server.close(linger=0)
        outbox.close(linger_ms=0)
        transport.close_context(context)


class Loop:
    """`call_soon` and `call_later` of a loop that the test turns itself (`turn`): the first
    look at the handshake comes after every answer was watched, however busy the machine."""

    def __init__(self) -> None:
        self.due: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def call_soon(self, function: Callable[..., Any], *args: Any) -> None:
        self.due.append((function, args))

    def call_later(self, delay_s: float, function: Callable[..., Any], *args: Any) -> None:
        self.due.append((function, args))

    def turn(self) -> None:
        due, self.due = self.due, []
        for function, args in due:
            function(*args)


@pytest.mark.parametrize("answers", [2, 3, 50])
def test_every_refused_answer_is_reported_one_by_one_or_through_its_owner(
    refusing_listener: tuple[transport.Outbox, str], answers: int
) -> None:
    outbox, address = refusing_listener
    most, owners = 3, ("ipc://owner-a", "ipc://owner-b")
    one_by_one: list[tuple[int, str]] = []
    every: list[tuple[str, str, str]] = []
    loop = Loop()
    waits = HandshakeWaits(
        outbox,
        loop.call_soon,
        loop.call_later,
        lambda owner, to, error: every.append((owner, to, str(error))),
        most=most,
    )
    for answer in range(answers):
        outbox.send(address, [b"an answer"])
        assert outbox.unconfirmed(address)
        owner = owners[answer % 2]
        waits.watch(address, lambda e, a=answer: one_by_one.append((a, str(e))), owner)
    kept = min(answers, most)
    told = {owners[a % 2] for a in range(most, answers)}  # the owners of the others

    def reported() -> bool:
        loop.turn()  # looks again while the handshake has not failed yet
        return len(one_by_one) == kept and len(every) == len(told)

    wait_until(reported, 30, "the refusal's reports")
    loop.turn()
    assert not loop.due  # nothing watched any more
    assert [a for a, _ in one_by_one] == list(range(kept))
    assert {owner for owner, _, _ in every} == told and len(every) == len(told)
    for why in [e for _, e in one_by_one] + [e for _, _, e in every]:
        assert address in why and "refused" in why and "CURVE keys" in why, why


@pytest.mark.parametrize("sends", [2, 3, 50])
def test_a_host_agent_reports_every_relayed_answer_refused_one_by_one_or_through_owners(
    refusing_listener: tuple[transport.Outbox, str], sends: int
) -> None:
    """The agent's watch over the answers of fanned-out calls it sent on (one loop, its own
    passes): each send is reported, past `most` through each (owner, proc) once."""
    outbox, address = refusing_listener
    most, pairs = 3, [("ipc://owner-a", "proc-a"), ("ipc://owner-b", "proc-b")]
    one_by_one: list[tuple[int, str]] = []
    every: list[tuple[str, str, str, object]] = []
    watch = RelayHandshakes(outbox, lambda *told: every.append(told), most=most)  # type: ignore[arg-type]
    for send in range(sends):
        outbox.send(address, [b"answers"])
        assert outbox.unconfirmed(address)
        told = [pairs[send % 2]]
        watch.watch(address, lambda e, s=send: one_by_one.append((s, str(e))), lambda t=told: t)
    kept = min(sends, most)
    owners = {pairs[s % 2] for s in range(most, sends)}

    def reported() -> bool:
        watch.check()  # looks again while the handshake has not failed yet
        return len(one_by_one) == kept and len(every) == len(owners)

    wait_until(reported, 30, "the refusal's reports")
    assert watch.due_in(5.0) == 5.0  # nothing watched any more
    assert [s for s, _ in one_by_one] == list(range(kept))
    assert {(owner, proc) for owner, proc, to, _ in every} == owners
    assert all(to == address for _, _, to, _ in every)
    for why in [e for _, e in one_by_one] + [str(e) for *_, e in every]:
        assert address in why and "refused" in why and "CURVE keys" in why, why


# -- the owner's side: every call made at that address that waits on that proc ends --------------


class Parker(Actor):
    """Holds its call until `go` exists: an answer that only the report can end before."""

    @endpoint
    def park(self, go: str) -> str:
        wait_until(lambda: Path(go).exists(), 60, "the test's go")
        return "PARKED"

    @endpoint
    def proc_id(self) -> str:
        return context().proc_id


class Asker(Actor):
    """Calls the parker from async code: the answers come to this proc's main inbox."""

    @endpoint
    def address(self) -> str:
        return inbox_address(local=True)

    @endpoint
    async def ask(self, parker: Any, go: str, times: int) -> list[str]:
        calls = [parker.park.call_one(go) for _ in range(times)]
        await anyio.Path(go + ".asked").touch()
        outcomes = []
        for call in calls:
            try:
                outcomes.append(str(await call))
            except SupervisionError as error:
                outcomes.append("FAILED " + str(error).replace("\n", " "))
        return outcomes


@pytest.mark.parametrize("told", ["caller", "owner"])
def test_a_report_that_every_answer_was_refused_ends_each_call_waiting_there(
    make_procs: Callable[..., Any], tmp_path: Path, told: str
) -> None:
    """Past the answers a proc keeps one by one, it tells the owner once that every answer
    to an address was refused (`EVERY_CALL`): the calls made there that wait on it end, each
    naming the proc and why. An owner that did not make them (here the client, for a call
    between its procs) hands the report to that address. A raw peer plays the proc."""
    procs = make_procs({"gpus": 2})
    parker = procs.slice(gpus=1).spawn("parker", Parker)
    asker = procs.slice(gpus=0).spawn("asker", Asker)
    parked_on = parker.proc_id.call_one().get(timeout=30)
    address, go = asker.address.call_one().get(timeout=30), str(tmp_path / "go")
    asked = asker.ask.call_one(parker, go, 3)
    wait_until(lambda: Path(go + ".asked").exists(), 30, "the calls to be made")
    reason = "tcp://127.0.0.1:1 refused this process's connection: other CURVE keys"
    lost = wire.ReplyLost(wire.EVERY_CALL, wire.EVERY_CALL, address, parked_on, "", reason)
    context_ = transport.new_context()
    outbox = transport.Outbox(context_)
    try:
        to = address if told == "caller" else inbox_address(local=True)
        outbox.send(to, transport.encode(lost, transport.Payload.dump(None)))
        outcomes = asked.get(timeout=30)
    finally:
        Path(go).touch()
        outbox.close(linger_ms=1000)
        transport.close_context(context_)
    assert len(outcomes) == 3, outcomes
    for outcome in outcomes:
        for part in ("FAILED", "unreachable", f"from proc {parked_on}", "CURVE keys"):
            assert part in outcome, outcome
