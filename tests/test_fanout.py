"""Calls fanned out through the host agent (one message per host, answers batched back) keep
the contract of calls sent to each actor: a rank that dies fails only its part, errors come
back per rank, and the messages to each actor arrive in the order they were sent, whichever
path (straight to the proc, or through its agent) each took."""

from __future__ import annotations

from typing import Any

import fanout_actors as fa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polling import wait_until

from mesh import ActorMesh
from supervision import ActorError, SupervisionError

T = 30  # seconds: the bound on every wait in this module (never reached when things work)


def fanned_out(actors: ActorMesh[Any]) -> list[bool]:
    """For each actor of `actors`: whether this client's last message to it went through the
    host agent (white box: proves the test exercised the fan-out path)."""
    state = actors._state
    return [
        (route := peer.routes.get(state.actor_id)) is not None and route.via_agent
        for peer in state.peers
    ]


@pytest.mark.timeout(90)
def test_a_rank_dying_in_a_fanned_out_call_fails_only_its_part(
    make_procs: Any, root_events: list[Any]
) -> None:
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


# (adverb, first rank, past the last rank) of a message to a slice of three actors
_MESSAGES = st.tuples(
    st.sampled_from(["call", "broadcast"]), st.integers(0, 2), st.integers(1, 3)
).filter(lambda m: m[1] < m[2])


@pytest.mark.timeout(240)
def test_messages_to_an_actor_arrive_in_order_on_either_path(
    make_procs: Any, no_failure_reaches_the_root: None
) -> None:
    """Calls and broadcasts to one actor (direct) or several (through their agent), pipelined
    without waiting: each actor receives its messages in the order they were sent."""
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
