"""The host agent's half of fanned-out calls batches what one pass over its inbox produced:
each proc gets that pass's calls in one frame, in the order they were sent, and each caller
gets the answers to all its calls in one frame (`mesh/_agent/relay.py`). Real zmq sockets
stand in for the procs and the caller; the relay is the agent's own."""

from __future__ import annotations

import contextlib
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_agent_hardening import client_home

from mesh.testing import FanOutRelay, ProcRecord, ProcTable, wire
from mesh.testing import fanout_wire as fw
from transport import (
    BATCH_MAGIC,
    MAX_BATCH_MESSAGES,
    Envelope,
    Outbox,
    Payload,
    close_context,
    decode,
    get_logger,
    new_context,
)

PROCS = 3
T_MS = 30_000  # the bound on every receive (never reached when things work)


class Sockets:
    """A PULL socket for each fake proc and one for the caller, bound in a private folder."""

    def __init__(self, context: zmq.Context[Any], folder: str) -> None:
        self.procs = [self._bind(context, f"ipc://{folder}/p{i}") for i in range(PROCS)]
        self.caller_address = f"ipc://{folder}/caller"
        self.caller = self._bind(context, self.caller_address)

    @staticmethod
    def _bind(context: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
        socket: zmq.Socket[Any] = context.socket(zmq.PULL)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVTIMEO, T_MS)
        socket.bind(address)
        return socket

    def close(self) -> None:
        for socket in (*self.procs, self.caller):
            socket.close(linger=0)


def messages_of(frame: memoryview) -> list[memoryview]:
    """The messages one frame carries: itself, or those of a batch (`b"MB\\x01"`, a u32
    count, then each message as a u32 length and its bytes)."""
    if frame[: len(BATCH_MAGIC)] != BATCH_MAGIC:
        return [frame]
    (count,), position, messages = struct.unpack_from("<I", frame, 3), 7, []
    for _ in range(count):
        (length,) = struct.unpack_from("<I", frame, position)
        messages.append(frame[position + 4 : position + 4 + length])
        position += 4 + length
    assert position == frame.nbytes
    return messages


def frames_waiting(socket: zmq.Socket[Any], wanted: int) -> list[list[Envelope]]:
    """The frames that reach `socket` until they carry `wanted` messages, each split into
    the messages it holds; then checks that nothing more came."""
    frames: list[list[Envelope]] = []
    while sum(map(len, frames)) < wanted:
        frame = memoryview(socket.recv(copy=False).buffer)
        frames.append([decode([message]) for message in messages_of(frame)])
    assert not socket.poll(0), "more messages than expected"
    return frames


@contextlib.contextmanager
def relay_with(**options: Any) -> Iterator[tuple[FanOutRelay, Sockets, str]]:
    """An agent's FanOutRelay (built with `options`) for PROCS connected procs, each a PULL
    socket of this test."""
    context = new_context()
    with contextlib.ExitStack() as stack, client_home() as home:
        stack.callback(close_context, context)
        folder = tempfile.mkdtemp(prefix="b", dir=home)
        sockets = Sockets(context, folder)
        stack.callback(sockets.close)
        outbox = Outbox(context)
        stack.callback(outbox.close, 0)
        table = ProcTable()
        for rank, socket in enumerate(sockets.procs):
            spec = wire.ProcSpec(f"p{rank}", "m", ("gpus",), (PROCS,), rank)
            address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
            record = ProcRecord(spec, "ipc://owner", address, 5.0, 5.0, connected=True)
            table.add(record)
        agent_address = f"ipc://{folder}/agent"
        log = get_logger("test.relay")
        yield FanOutRelay(table, outbox, agent_address, log, **options), sockets, agent_address


@pytest.fixture
def relay_and_sockets() -> Iterator[tuple[FanOutRelay, Sockets, str]]:
    with relay_with() as found:
        yield found


# per fanned-out call: the ranks it goes to (a non-empty subset), and whether it is a call
_FAN_OUTS = st.lists(
    st.tuples(st.sets(st.integers(0, PROCS - 1), min_size=1), st.booleans()),
    min_size=1,
    max_size=MAX_BATCH_MESSAGES,
)


@pytest.mark.timeout(120)
def test_one_pass_reaches_each_proc_in_one_frame_in_order_and_answers_leave_together(
    relay_and_sockets: tuple[FanOutRelay, Sockets, str],
) -> None:
    relay, sockets, agent_address = relay_and_sockets

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_FAN_OUTS)
    def batched_in_order(fan_outs: list[tuple[set[int], bool]]) -> None:
        sent: dict[int, list[int]] = {rank: [] for rank in range(PROCS)}
        for call_id, (ranks, answered) in enumerate(fan_outs, 1):
            reply_to = sockets.caller_address if answered else None
            message = wire.CallActor(call_id, reply_to, "a", "ep", ("gpus",), (PROCS,), 0)
            ordered = sorted(ranks)
            targets = (tuple(f"p{rank}" for rank in ordered), tuple(ordered))
            assert relay.handle(Envelope(fw.FanOut(message, *targets), Payload(b"x%d" % call_id)))
            for rank in ranks:
                sent[rank].append(call_id)
        relay.flush()  # the end of the agent's pass over its inbox
        answers_awaited = 0
        for rank, socket in enumerate(sockets.procs):
            if not sent[rank]:
                assert not socket.poll(0)
                continue
            (frame,) = frames_waiting(socket, len(sent[rank]))  # one frame: the whole pass
            assert [int(bytes(e.payload.body)[1:]) for e in frame] == sent[rank]  # type: ignore[union-attr]
            for envelope in frame:
                call = envelope.header
                assert (type(call), call.rank) == (wire.CallActor, rank)
                assert call.reply_to in (None, agent_address)
                if call.reply_to is not None:  # the proc answers the agent
                    answers_awaited += 1
                    answer = Envelope(wire.Reply(call.call_id, rank), Payload.dump(rank))
                    assert relay.handle(answer)
        relay.flush()
        if not answers_awaited:
            assert not sockets.caller.poll(0)
            return
        calls_answered = sum(1 for _, answered in fan_outs if answered)
        (frame,) = frames_waiting(sockets.caller, calls_answered)  # every call's answers
        got = {}
        for batch in frame:
            for answer in fw.unpack_answers(batch):
                got[answer.header.call_id, answer.header.rank] = answer.payload.load()  # type: ignore[union-attr]
        wanted = {
            (call_id, rank): rank
            for call_id, (ranks, answered) in enumerate(fan_outs, 1)
            if answered
            for rank in ranks
        }
        assert got == wanted

    batched_in_order()


def call_all(relay: FanOutRelay, sockets: Sockets) -> list[Any]:
    """Fan one answered call out to every proc; the call as each proc got it."""
    message = wire.CallActor(1, sockets.caller_address, "a", "ep", ("gpus",), (PROCS,), 0)
    targets = (tuple(f"p{rank}" for rank in range(PROCS)), tuple(range(PROCS)))
    assert relay.handle(Envelope(fw.FanOut(message, *targets), Payload(b"x")))
    relay.flush()
    return [frames_waiting(socket, 1)[0][0].header for socket in sockets.procs]


def answer(relay: FanOutRelay, call: Any) -> None:
    assert relay.handle(Envelope(wire.Reply(call.call_id, call.rank), Payload.dump(call.rank)))
    relay.flush()


def ranks_answered(socket: zmq.Socket[Any]) -> list[int]:
    """The ranks of the one batch of answers that reaches the caller's socket."""
    ((batch,),) = frames_waiting(socket, 1)
    return sorted(answer.header.rank for answer in fw.unpack_answers(batch))


@pytest.mark.timeout(60)
def test_answers_wait_for_the_rest_of_their_call_until_its_last_answer_or_the_hold_ends() -> None:
    with relay_with(hold_s=3600.0) as (relay, sockets, _):
        calls = call_all(relay, sockets)
        for call in calls[:-1]:
            answer(relay, call)
        assert not sockets.caller.poll(0), "answers left while their call awaited another"
        assert relay.due_in(10.0) == 10.0
        answer(relay, calls[-1])  # the last one: all leave at once, in one batch
        assert ranks_answered(sockets.caller) == list(range(PROCS))
        assert relay.due_in(10.0) == 10.0
    with relay_with(hold_s=0.0) as (relay, sockets, _):
        calls = call_all(relay, sockets)
        answer(relay, calls[0])  # held no time: leaves alone
        assert ranks_answered(sockets.caller) == [0]


@pytest.mark.timeout(60)
def test_held_answers_leave_when_a_proc_exits_ahead_of_its_exit_report() -> None:
    """The agent reports an exit right after `proc_exited`: an answer the proc gave before it
    died must not be held past that report (the caller would fail a rank that answered)."""
    with relay_with(hold_s=3600.0) as (relay, sockets, _):
        calls = call_all(relay, sockets)
        answer(relay, calls[0])
        assert not sockets.caller.poll(0)
        relay.proc_exited("p0")
        assert ranks_answered(sockets.caller) == [0]
