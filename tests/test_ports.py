"""Channels and ports, with real procs: a Port goes to actors inside messages and is sent to
from anywhere; endpoints answer through an explicit response port; every failure ends the
wait (a dead receiver fails the sender, a port whose holders all died fails ``recv()``)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import zmq
from polling import wait_until

from mesh import Actor, Channel, Port, current_rank, endpoint
from mesh.testing import exit_process, inbox_address, wire
from supervision import ActorError, SupervisionError
from transport import Addresses, Payload, encode

T = 30.0


class Sender(Actor):
    """Sends to ports it is given, or keeps one to send to later."""

    def __init__(self) -> None:
        self.kept: Port[Any] | None = None

    @endpoint
    def send_many(self, port: Port[Any], count: int) -> int:
        for i in range(count):
            port.send((current_rank().rank, i))
        return os.getpid()

    @endpoint
    def send_then_mark(self, port: Port[Any], count: int, marker: Port[Any]) -> None:
        for i in range(count):
            port.send(i)
        marker.send("done")

    @endpoint
    def send_error(self, port: Port[Any], message: str) -> None:
        port.exception(KeyError(message))

    @endpoint
    def keep(self, port: Port[Any]) -> int:
        self.kept = port
        return os.getpid()

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def send_kept(self, value: Any) -> str:
        """Send to the kept port; the name of what sending raised, or "sent"."""
        assert self.kept is not None
        try:
            self.kept.send(value)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "sent"


class Receiver(Actor):
    """Opens a channel in its proc and receives on it."""

    def __init__(self) -> None:
        self.port, self.receiver = Channel[Any].open()

    @endpoint
    def port_of(self) -> Port[Any]:
        return self.port

    @endpoint
    def take(self, count: int) -> list[Any]:
        return [self.receiver.recv().get(timeout=T) for _ in range(count)]

    @endpoint
    async def atake(self, count: int) -> list[Any]:
        return [await self.receiver.recv() for _ in range(count)]

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Answers(Actor):
    """Endpoints with an explicit response port."""

    def __init__(self) -> None:
        self.held: list[tuple[Any, int]] = []
        self.second_send = ""

    @endpoint(explicit_response_port=True)
    def later(self, port: Any, value: int) -> None:
        self.held.append((port, value))

    @endpoint
    def release(self) -> int:
        for port, value in self.held:
            port.send(value * 10)
        released, self.held = len(self.held), []
        return released

    @endpoint(explicit_response_port=True)
    async def now(self, port: Any, value: int) -> str:
        port.send(value + current_rank().rank)
        return "ignored"

    @endpoint(explicit_response_port=True)
    def twice(self, port: Any) -> None:
        port.send("first")
        try:
            port.send("second")
        except ValueError as exc:
            self.second_send = str(exc)

    @endpoint
    def second_send_error(self) -> str:
        return self.second_send

    @endpoint(explicit_response_port=True)
    def forget(self, port: Any) -> None:
        pass

    @endpoint(explicit_response_port=True)
    def raise_first(self, port: Any) -> None:
        raise LookupError("nothing to answer")

    @endpoint(explicit_response_port=True)
    def answer_with_error(self, port: Any) -> None:
        port.exception(ValueError("told through the port"))

    @endpoint(explicit_response_port=True)
    def pickle_port(self, port: Any) -> None:
        try:
            pickle.dumps(port)
        except TypeError as exc:
            port.send(str(exc))

    @endpoint
    def crash(self) -> None:
        raise SystemExit("the actor gives up")

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _wait_dead(actors: Any) -> None:
    """Until the client knows that the proc of `actors` (one actor) is gone."""
    with pytest.raises(SupervisionError):
        actors.pid.call_one().get(timeout=T)


# -- channels ------------------------------------------------------------------------------------


def test_a_port_goes_to_actors_and_keeps_each_senders_order(procs: Any) -> None:
    senders = procs.spawn("senders", Sender)
    port, receiver = Channel[tuple[int, int]].open()
    senders.send_many.call(port, 20).get(timeout=T)
    got = [receiver.recv().get(timeout=T) for _ in range(40)]
    for rank in (0, 1):
        assert [i for r, i in got if r == rank] == list(range(20))


def test_recv_can_be_awaited(procs: Any) -> None:
    senders = procs.spawn("senders", Sender)
    port, receiver = Channel[tuple[int, int]].open()

    async def main() -> list[tuple[int, int]]:
        senders.send_many.call(port, 3).get(timeout=T)
        return [await receiver.recv() for _ in range(6)]

    assert sorted(anyio.run(main)) == sorted((r, i) for r in (0, 1) for i in range(3))


def test_a_port_opened_in_an_actor_receives_from_the_client_and_other_actors(
    make_procs: Callable[..., Any],
) -> None:
    receivers = make_procs({"gpus": 1}).spawn("receivers", Receiver)
    senders = make_procs({"gpus": 2}).spawn("senders", Sender)
    port = receivers.port_of.call_one().get(timeout=T)
    port.send("from the client")
    assert receivers.take.call_one(1).get(timeout=T) == ["from the client"]
    senders.send_many.call(port, 2).get(timeout=T)
    got = receivers.atake.call_one(4).get(timeout=T)
    assert sorted(got) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_once_port_keeps_its_first_message_only(procs: Any) -> None:
    senders = procs.spawn("senders", Sender)
    port, receiver = Channel[Any].open(once=True)
    marker, marks = Channel[str].open()
    senders.slice(gpus=0).send_then_mark.call_one(port, 3, marker).get(timeout=T)
    assert marks.recv().get(timeout=T) == "done"
    assert receiver.recv().get(timeout=T) == 0
    with pytest.raises(ValueError, match="once port and delivered its message already"):
        receiver.recv().get(timeout=T)


def test_a_full_receiver_drops_and_recv_says_so(procs: Any) -> None:
    senders = procs.spawn("senders", Sender)
    port, receiver = Channel[int].open(bound=2)
    marker, marks = Channel[str].open()
    senders.slice(gpus=0).send_then_mark.call_one(port, 5, marker).get(timeout=T)
    assert marks.recv().get(timeout=T) == "done"  # the same sender: its 5 messages came first
    assert [receiver.recv().get(timeout=T) for _ in range(2)] == [0, 1]
    with pytest.raises(OverflowError, match=r"3 message\(s\) were dropped.*bound 2"):
        receiver.recv().get(timeout=T)


def test_an_exception_sent_to_a_port_is_raised_by_recv(procs: Any) -> None:
    senders = procs.spawn("senders", Sender)
    port, receiver = Channel[Any].open()
    senders.slice(gpus=1).send_error.call_one(port, "missing").get(timeout=T)
    with pytest.raises(KeyError, match="missing"):
        receiver.recv().get(timeout=T)


def test_a_closed_receiver_fails_its_waiters() -> None:
    port, receiver = Channel[int].open()
    waiting = receiver.recv()
    receiver.close()
    with pytest.raises(ValueError, match="receiver was closed"):
        waiting.get(timeout=T)
    port.send(1)  # dropped at the receiver's process, which logs it
    with pytest.raises(ValueError, match="receiver was closed"):
        receiver.recv().get(timeout=T)


def test_bad_channel_input_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="bound of at least 1"):
        Channel.open(bound=0)
    port, receiver = Channel[int].open()
    with pytest.raises(TypeError, match="needs an exception"):
        port.exception("not an exception")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot leave the process"):
        pickle.dumps(receiver)


# -- failures --------------------------------------------------------------------------------


def test_sending_to_a_port_whose_receiver_died_raises(
    make_procs: Callable[..., Any], root_events: list[Any]
) -> None:
    receivers = make_procs({"gpus": 1}).spawn("receivers", Receiver)
    senders = make_procs({"gpus": 1}).spawn("senders", Sender)
    port = receivers.port_of.call_one().get(timeout=T)
    senders.keep.call_one(port).get(timeout=T)
    exit_process(receivers, 3)
    _wait_dead(receivers)
    with pytest.raises(SupervisionError, match="its receiver's proc is gone"):
        port.send("from the client")
    outcome: list[str] = []
    wait_until(  # the sender's proc hears of the death from the receiver's agent
        lambda: (
            outcome.append(senders.send_kept.call_one(1).get(timeout=T)) or outcome[-1] != "sent"
        ),
        what="the sender to learn that the receiver's proc is gone",
    )
    assert outcome[-1].startswith("SupervisionError: cannot send to port")
    wait_until(lambda: root_events, what="the receiver's death to reach its owner")


def test_recv_fails_once_every_holder_of_the_port_died(
    make_procs: Callable[..., Any], root_events: list[Any]
) -> None:
    senders = make_procs({"gpus": 2}).spawn("senders", Sender)
    port, receiver = Channel[Any].open()
    senders.keep.call(port).get(timeout=T)
    waiting = receiver.recv()
    exit_process(senders.slice(gpus=0), 3)
    _wait_dead(senders.slice(gpus=0))
    assert not waiting.done(), "a holder is still alive: a message may still come"
    marker, marks = Channel[str].open()  # held by rank 1 only
    senders.slice(gpus=1).send_then_mark.call_one(port, 2, marker).get(timeout=T)
    assert marks.recv().get(timeout=T) == "done"
    assert waiting.get(timeout=T) == 0
    waiting_for_mark = marks.recv()
    exit_process(senders.slice(gpus=1), 3)
    with pytest.raises(SupervisionError, match="every process holding it is gone"):
        waiting_for_mark.get(timeout=T)  # a waiter is woken by the death of the last holder
    assert receiver.recv().get(timeout=T) == 1, "what came before the deaths is delivered"
    with pytest.raises(SupervisionError, match="every process holding it is gone") as info:
        receiver.recv().get(timeout=T)
    assert info.value.event.proc_id in str(info.value)
    assert root_events


# -- explicit response ports ---------------------------------------------------------------------


def test_a_response_port_answers_later_from_another_endpoint(procs: Any) -> None:
    answers = procs.spawn("answers", Answers).slice(gpus=0)
    pending = [answers.later.call_one(1), answers.later.call_one(2)]
    assert answers.release.call_one().get(timeout=T) == 2
    assert [f.get(timeout=T) for f in pending] == [10, 20]


def test_async_endpoints_answer_a_mesh_call_through_their_ports(procs: Any) -> None:
    answers = procs.spawn("answers", Answers)
    assert answers.now.call(5).get(timeout=T).values() == (5, 6)
    assert sorted(f.get(timeout=T) for f in answers.now.stream(1)) == [1, 2]


def test_a_response_port_answers_once(procs: Any) -> None:
    answers = procs.spawn("answers", Answers).slice(gpus=1)
    assert answers.twice.call_one().get(timeout=T) == "first"
    assert "answered already" in answers.second_send_error.call_one().get(timeout=T)
    assert "pass a Port from Channel.open()" in answers.pickle_port.call_one().get(timeout=T)


def test_a_response_port_never_leaves_its_caller_waiting(procs: Any) -> None:
    answers = procs.spawn("answers", Answers).slice(gpus=0)
    with pytest.raises(ActorError, match="dropped its response port without answering"):
        answers.forget.call_one().get(timeout=T)
    with pytest.raises(ActorError, match="nothing to answer") as info:
        answers.raise_first.call_one().get(timeout=T)
    assert isinstance(info.value.exception, LookupError)
    with pytest.raises(ValueError, match="told through the port"):
        answers.answer_with_error.call_one().get(timeout=T)
    assert answers.now.call_one(1).get(timeout=T) == 1, "the actor lives on"


def test_an_unanswered_port_fails_when_its_actor_fails(procs: Any, root_events: list[Any]) -> None:
    answers = procs.spawn("answers", Answers).slice(gpus=0)
    pending = answers.later.call_one(1)
    with pytest.raises(SupervisionError):
        answers.crash.call_one().get(timeout=T)
    with pytest.raises(SupervisionError, match="the actor gives up"):
        pending.get(timeout=T)


def test_an_unanswered_port_fails_when_its_proc_dies(procs: Any, root_events: list[Any]) -> None:
    answers = procs.spawn("answers", Answers).slice(gpus=1)
    pending = answers.later.call_one(1)
    answers.pid.call_one().get(timeout=T)  # the call above is held by now
    exit_process(answers, 3)
    with pytest.raises(SupervisionError) as info:
        pending.get(timeout=T)
    assert dict(info.value.event.rank or {}) == {"gpus": 1}


def test_a_holder_passes_a_port_on_with_the_addresses_its_receiver_announced(
    make_procs: Callable[..., Any],
) -> None:
    """A port's receiver that begins to listen on tcp tells its holders (`ReceiverAddresses`):
    a copy they pass on carries the new set. A malformed announcement is dropped, and the
    messages after it are still handled (a raw peer sends them to this client's inbox)."""
    receivers = make_procs({"gpus": 1}).spawn("receivers", Receiver)
    port = receivers.port_of.call_one().get(timeout=T)
    _, (carried, _, proc_id, _) = port.__reduce__()
    assert carried.tcp is None
    marker, marks = Channel[Any].open()
    context = zmq.Context()
    peer = context.socket(zmq.PUSH)
    try:
        peer.connect(inbox_address(local=True))
        good = wire.ReceiverAddresses(proc_id, carried.ipc, "tcp://127.0.0.1:9")
        bad = wire.ReceiverAddresses(proc_id, carried.ipc, "not an address")
        mark = wire.PortMessage(marker._port_id, -1, "value")
        for header, payload in ((good, None), (bad, None), (mark, Payload.dump("marked"))):
            peer.send_multipart(encode(header, payload))
        assert marks.recv().get(timeout=T) == "marked"  # after the others: same sender
    finally:
        peer.close(linger=0)
        context.term()
    _, (passed_on, *_) = port.__reduce__()
    assert passed_on == Addresses(carried.ipc, "tcp://127.0.0.1:9")
    port.send("still reaches it over ipc from this host")
    assert receivers.take.call_one(1).get(timeout=T) == ["still reaches it over ipc from this host"]
