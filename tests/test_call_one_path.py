"""A call to one actor (`call_one`, `choose`) takes a short path straight to its proc, and a
reply's header is encoded from its fields. Mixed with messages that take the general path
(calls and broadcasts to slices, straight or fanned out through the host agent), each actor
still receives its messages in the order they were sent, each exactly once."""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import actors
import fanout_actors as fa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.testing import fan_out_from, fanned_out
from transport import (
    Payload,
    SerializationError,
    decode,
    encode,
    encode_fields,
    message_type,
)

T = 30  # seconds: the bound on every wait in this module (never reached when things work)
RANKS = 3

#: (adverb, first rank, end rank): one actor for "call_one", a slice for the others.
_MESSAGES = st.one_of(
    st.tuples(st.just("call_one"), st.integers(0, RANKS - 1)).map(lambda m: (*m, m[1] + 1)),
    st.tuples(
        st.sampled_from(["call", "broadcast", "choose"]),
        st.integers(0, RANKS - 1),
        st.integers(1, RANKS),
    ).filter(lambda m: m[1] < m[2]),
)


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    with contextlib.ExitStack() as stack:
        yield stack


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fan_out_at", [1, 2])
def test_calls_to_one_actor_keep_order_with_calls_on_the_general_path(
    make_procs: Any,
    no_failure_reaches_the_root: None,
    stack: contextlib.ExitStack,
    fan_out_at: int,
) -> None:
    """Pipelined without waiting, in any mix: every actor notes exactly the tokens sent to it,
    in the order they were sent. With `fan_out_at` 1 even a call to one actor may go through
    the agent, so the short path must give way to it while earlier messages are on that path."""
    stack.enter_context(fan_out_from(fan_out_at))
    recorder = make_procs({"gpus": RANKS}).spawn("recorder", fa.RankedRecorder)
    recorder.take.call().get(timeout=T)
    paths_seen: set[bool] = set()

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(_MESSAGES, min_size=1, max_size=12))
    def messages_arrive_in_order_once(messages: list[tuple[str, int, int]]) -> None:
        sent: dict[int, list[int]] = {rank: [] for rank in range(RANKS)}
        chosen: list[tuple[int, int, Any]] = []
        futures = []
        for token, (adverb, first, last) in enumerate(messages):
            actors = recorder.slice(gpus=slice(first, last))
            if adverb == "call_one":
                futures.append(actors.note_rank.call_one(token))
            elif adverb == "choose":
                chosen.append((token, first, actors.note_rank.choose(token)))
            elif adverb == "call":
                futures.append(actors.note_rank.call(token))
            else:
                actors.note_rank.broadcast(token)
            if adverb != "choose":
                for rank in range(first, last):
                    sent[rank].append(token)
            paths_seen.update(fanned_out(recorder)[first:last])
        for future in futures:
            future.get(timeout=T)
        for token, first, future in chosen:  # its recipient is known once it answered
            sent[first + future.get(timeout=T)].append(token)  # (its rank in the slice)
        received = recorder.take.call().get(timeout=T)
        # tokens count up in the order they were sent: that order is the sorted one
        assert {rank: received.item(gpus=rank) for rank in range(RANKS)} == {
            rank: sorted(tokens) for rank, tokens in sent.items()
        }

    messages_arrive_in_order_once()
    if fan_out_at == 2:
        assert paths_seen == {True, False}, "both paths must have been taken"


@pytest.mark.timeout(60)
def test_threads_taking_turns_on_one_endpoint_each_get_their_own_answers(
    make_procs: Any, no_failure_reaches_the_root: None
) -> None:
    """Each thread has its own reply address, so a call's header differs from one thread to
    the next: calls to one endpoint of one handle, from threads taking turns (and to each
    rank in turn), each come back to the thread that made them, with their own value."""
    echo = make_procs({"gpus": 2}).spawn("echo", actors.Echo)
    pids = echo.pid.call().get(timeout=T).values()
    ones = [echo.slice(gpus=rank) for rank in range(2)]
    turns = [threading.Semaphore(1), threading.Semaphore(0)]

    def take_turns(me: int) -> list[tuple[Any, int]]:
        got = []
        for i in range(10):
            with contextlib.ExitStack() as stack:
                assert turns[me].acquire(timeout=T)
                stack.callback(turns[1 - me].release)
                one = ones[i % 2]
                got.append(
                    (one.echo.call_one((me, i)).get(timeout=T), one.pid.call_one().get(timeout=T))
                )
        return got

    with concurrent.futures.ThreadPoolExecutor(1) as other:
        theirs = other.submit(take_turns, 1)
        mine = take_turns(0)
        assert theirs.result(timeout=T) == [((1, i), pids[i % 2]) for i in range(10)]
    assert mine == [((0, i), pids[i % 2]) for i in range(10)]


@pytest.mark.timeout(60)
def test_a_call_to_one_actor_names_itself_when_it_times_out(
    make_procs: Any, no_failure_reaches_the_root: None
) -> None:
    """A future of `call_one` or `choose` is described only when something writes it (its
    timeout, its repr): it still names the adverb, the mesh and the endpoint."""
    sleeper = make_procs({"gpus": 1}).spawn("sleeper", actors.Sleeper)
    for adverb in ("call_one", "choose"):
        future = getattr(sleeper.sleep, adverb)(0.5)
        assert repr(future) == f"<Future {adverb}() of sleeper.sleep pending>"
        with pytest.raises(TimeoutError, match=rf"^{adverb}\(\) of sleeper.sleep did not finish"):
            future.get(timeout=0.01)
        assert future.get(timeout=T) == "slept"
        assert repr(future) == f"<Future {adverb}() of sleeper.sleep done>"


@message_type
@dataclass(frozen=True, slots=True)
class Sample:
    """A test header with fields of several plain types."""

    number: int
    text: str
    shape: tuple[int, ...]
    maybe: str | None


_FIELDS = st.tuples(
    st.integers(-(2**70), 2**70),
    st.text(max_size=40),
    st.lists(st.integers(0, 2**40), max_size=5).map(tuple),
    st.none() | st.text(max_size=10),
)


@settings(max_examples=200, deadline=None)
@given(_FIELDS, st.binary(max_size=64) | st.none())
def test_a_header_encoded_from_its_fields_is_the_header_encoded(
    fields: tuple[Any, ...], body: bytes | None
) -> None:
    """`encode_fields(kind, fields)` is received as `encode(kind(*fields))` is (marshal's
    bytes may differ in reference flags, which depend on reference counts)."""
    payload = None if body is None else Payload(body)
    received = decode(encode_fields(Sample, fields, payload))
    expected = decode(encode(Sample(*fields), payload))
    assert received.header == expected.header == Sample(*fields)
    assert _body(received.payload) == _body(expected.payload)


def _body(payload: Payload | None) -> bytes | None:
    return None if payload is None else bytes(payload.body)


@pytest.mark.parametrize(
    ("kind", "fields", "why"),
    [
        (Sample, (1, "a", ()), "made of 3 fields"),
        (Sample, (1, "a", (), None, 5), "made of 5 fields"),
        (dict, (), "registered with @message_type"),
        (Sample, (1, "a", (), object()), "plain values"),
    ],
)
def test_a_header_from_wrong_fields_is_refused_with_the_reason(
    kind: type, fields: tuple[Any, ...], why: str
) -> None:
    with pytest.raises(SerializationError, match=why):
        encode_fields(kind, fields, None)
