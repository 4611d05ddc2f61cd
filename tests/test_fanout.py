"""Calls fanned out through the host agent (one message per host, answers batched back) keep
the contract of calls sent to each actor: a rank that dies fails only its part, errors come
back per rank, and the messages to each actor arrive in the order they were sent, whichever
path (straight to the proc, or through its agent) each took."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import actors
import fanout_actors as fa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polling import wait_until
from test_agent_hardening import agent_barrier, raw_peer

import mesh.testing
from mesh.testing import fan_out_from, fanned_out, wire
from mesh.testing import fanout_wire as fw
from supervision import ActorError, SupervisionError
from transport import Envelope, Payload, decode, encode

T = 30  # seconds: the bound on every wait in this module (never reached when things work)


@pytest.mark.timeout(90)
def test_a_rank_dying_in_a_fanned_out_call_fails_only_its_part(
    make_procs: Any, root_events: list[Any], stack: contextlib.ExitStack
) -> None:
    stack.enter_context(fan_out_from(2))  # the two survivors below fan out too
    procs = make_procs({"gpus": 4})
    dies = procs.spawn("dies", fa.Dies)
    assert sorted(dies.rank.call().get(timeout=T).values()) == [0, 1, 2, 3]
    assert sorted(dies.rank.call().get(timeout=T).values()) == [0, 1, 2, 3]
    assert fanned_out(dies) == [True] * 4

    outcomes = []
    for future in dies.rank_or_die.stream(2):
        try:
            outcomes.append(future.get(timeout=T))
        except SupervisionError as exc:
            outcomes.append(exc)
    assert sorted(o for o in outcomes if isinstance(o, int)) == [0, 1, 3]
    (error,) = [o for o in outcomes if isinstance(o, SupervisionError)]
    event = error.event
    assert (event.mesh_name, dict(event.rank or {}), event.signal) == (
        "dies",
        {"gpus": 2},
        "SIGKILL",
    )
    wait_until(lambda: root_events, what="the death of rank 2 reaching the root", timeout=T)
    root_events.clear()

    with pytest.raises(SupervisionError, match="dies"):
        dies.rank.call().get(timeout=T)
    survivors = dies.slice(gpus=slice(0, 2))
    assert list(survivors.rank.call().get(timeout=T).values()) == [0, 1]
    with pytest.raises(ValueError, match="boom") as raised:  # an exception, through a batch
        survivors.fail.call("boom").get(timeout=T)
    assert isinstance(raised.value, ActorError)
    assert fanned_out(dies)[:2] == [True, True]
    assert not root_events


def test_answers_and_errors_of_one_batch_settle_each_rank_with_its_own(make_procs: Any) -> None:
    """Values and exceptions that come back in the same batches: each rank gets its own
    outcome (a stream sees all of them, the values and an ActorError naming each failed rank),
    a call gathers the values, and the next call goes the same way."""
    procs = make_procs({"gpus": 6})
    with fan_out_from(2):
        ranked = procs.spawn("ranked", fa.Dies)
        for _ in range(2):
            outcomes: dict[int, Any] = {}
            for future in ranked.rank_or_raise.stream(True):
                try:
                    rank = future.get(timeout=T)
                    outcomes[rank] = rank
                except ValueError as exc:
                    assert isinstance(exc, ActorError) and exc.rank is not None
                    outcomes[exc.rank["gpus"]] = exc
            assert sorted(outcomes) == list(range(6))
            assert all(isinstance(outcomes[r], ActorError) == bool(r % 2) for r in range(6))
            gathered = ranked.rank_or_raise.call(False).get(timeout=T)
            assert list(gathered.values()) == list(range(6))
            with pytest.raises(ValueError, match="refuses"):
                ranked.rank_or_raise.call(True).get(timeout=T)
        assert fanned_out(ranked) == [True] * 6


# (adverb, first rank, past the last rank) of a message to a slice of three actors
_MESSAGES = st.tuples(
    st.sampled_from(["call", "broadcast"]), st.integers(0, 2), st.integers(1, 3)
).filter(lambda m: m[1] < m[2])


@pytest.mark.timeout(240)
def test_messages_to_an_actor_arrive_in_order_on_either_path(
    make_procs: Any, no_failure_reaches_the_root: None, stack: contextlib.ExitStack
) -> None:
    """Calls and broadcasts to one actor (direct) or several (through their agent), pipelined
    without waiting: each actor receives its messages in the order they were sent."""
    stack.enter_context(fan_out_from(2))  # slices of 2 of the 3 actors fan out too
    recorder = make_procs({"gpus": 3}).spawn("recorder", fa.Recorder)
    recorder.take.call().get(timeout=T)
    paths_seen: set[bool] = set()

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(_MESSAGES, min_size=1, max_size=12))
    def messages_arrive_in_order(messages: list[tuple[str, int, int]]) -> None:
        sent: dict[int, list[int]] = {rank: [] for rank in range(3)}
        futures = []
        for token, (adverb, first, last) in enumerate(messages):
            endpoint = recorder.slice(gpus=slice(first, last)).note
            if adverb == "call":
                futures.append(endpoint.call(token))
            else:
                endpoint.broadcast(token)
            paths_seen.update(fanned_out(recorder)[first:last])
            for rank in range(first, last):
                sent[rank].append(token)
        for future in futures:
            future.get(timeout=T)
        received = recorder.take.call().get(timeout=T)
        assert {rank: received.item(gpus=rank) for rank in range(3)} == sent

    messages_arrive_in_order()
    assert paths_seen == {True, False}, "both paths must have been taken"


@pytest.mark.timeout(60)
def test_the_agent_relays_well_formed_fan_outs_and_refuses_the_others(make_procs: Any) -> None:
    echo = make_procs({"gpus": 2}).spawn("echo", actors.Echo)
    assert list(echo.echo.call(1).get(timeout=T).values()) == [1, 1]
    actor_id, peers = echo._state.actor_id, echo._state.peers
    targets = ((peers[0].proc_id, 0), (peers[1].proc_id, 1))
    agent = mesh.testing.local_agent()
    with raw_peer(agent.address) as peer:

        def call(call_id: int, reply_to: str) -> wire.CallActor:
            return wire.CallActor(call_id, reply_to, actor_id, "echo", ("gpus",), (2,), 0)

        args = Payload.dump(((5,), {}))
        refused = [
            _fan_out(call(1, "file:///nowhere"), targets),  # no address to answer
            _fan_out(call(2, peer.inbox.address), ((peers[0].proc_id, 2),)),  # outside the sizes
            _fan_out(call(3, peer.inbox.address), (targets[0], targets[0])),  # a rank twice
            fw.FanOut(call(6, peer.inbox.address), (peers[0].proc_id,), (0, 1)),  # a rank no proc
        ]
        for request in refused:
            peer.send(encode(request, args))
        unknown = ("never-ran-0", 1)  # skipped: its exit report is what tells a caller
        peer.send(encode(_fan_out(call(4, peer.inbox.address), (targets[0], unknown)), args))
        peer.send(encode(_fan_out(call(5, peer.inbox.address), targets), args))
        answers: dict[tuple[int, int], Any] = {}
        while len(answers) < 3:
            assert peer.inbox.poll(int(T * 1000)), f"answers so far: {answers}"
            batch = peer.inbox.receive_nowait()
            assert batch is not None and type(batch.header) is fw.RelayedReplies, batch
            for answer in fw.unpack_answers(batch):
                answers[answer.header.call_id, answer.header.rank] = answer.payload.load()  # type: ignore[union-attr]
        assert answers == {(4, 0): 5, (5, 0): 5, (5, 1): 5}
        agent_barrier(peer)
    assert agent.process.poll() is None
    assert list(echo.echo.call(2).get(timeout=T).values()) == [2, 2]


_ANSWERS = st.lists(
    st.tuples(
        st.integers(0, 1 << 20),
        st.sampled_from(["", "exception", "failed", "stopped"]),
        st.binary(max_size=40),
        st.lists(st.binary(min_size=1, max_size=20), max_size=3),
    ),
    max_size=12,
)


@given(_ANSWERS, st.data())
def test_a_batch_of_answers_unpacks_into_the_answers_packed(
    answers: list[tuple[int, str, bytes, list[bytes]]], data: st.DataObject
) -> None:
    packed = [
        (rank, kind, Payload(body, buffers) if body or buffers else None)
        for rank, kind, body, buffers in answers
    ]
    header, payload = fw.pack_answers(7, packed)
    envelope = decode(encode(header, payload))
    unpacked = [
        (e.header.rank, getattr(e.header, "kind", ""), *_bytes_of(e.payload))
        for e in fw.unpack_answers(envelope)
    ]
    assert unpacked == [(rank, kind, body, buffers) for rank, kind, body, buffers in answers]
    assert all(e.header.call_id == 7 for e in fw.unpack_answers(envelope))
    if answers:  # a batch whose entries do not add up to its payload is refused, not misread
        index = data.draw(st.integers(0, len(answers) - 1))
        sizes = list(header.sizes)
        sizes[index] += data.draw(st.integers(1, 5))
        bad = fw.RelayedReplies(7, header.ranks, header.kinds, tuple(sizes), header.counts)
        with pytest.raises(ValueError, match="declares"):
            fw.unpack_answers(Envelope(bad, envelope.payload))


def _fan_out(message: wire.CallActor, targets: tuple[tuple[str, int], ...]) -> Any:
    """A FanOut of `message` to (proc id, rank) `targets`."""
    return fw.FanOut(message, tuple(p for p, _ in targets), tuple(r for _, r in targets))


def _bytes_of(payload: Payload | None) -> tuple[bytes, list[bytes]]:
    if payload is None:
        return b"", []
    return bytes(payload.body), [bytes(b) for b in payload.buffers]


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    """Context managers a test enters, left after it, pass or fail."""
    with contextlib.ExitStack() as entered:
        yield entered
