"""`recovery.testing.LoopRounds`, the decisions of a `LoopGroup`, against simulated loops
that follow the protocol while hypothesis kills, respawns and fails them in any order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recovery import ReplicaGroupError
from recovery.testing import LoopRounds as Rounds
from recovery.testing import loop_wire

AskQuorum, Decision, Envelope = loop_wire.AskQuorum, loop_wire.Decision, loop_wire.Envelope
Finished, Go, Healed, HealFrom = (
    loop_wire.Finished,
    loop_wire.Go,
    loop_wire.Healed,
    loop_wire.HealFrom,
)
Retry, Vote, parse_request = loop_wire.Retry, loop_wire.Vote, loop_wire.parse_request

UNTIL = 4


@dataclass
class SimLoop:
    """A loop as `Manager` runs it: its committed step, what it waits for, its answer."""

    index: int
    incarnation: int = 0
    step: int = 0
    state: str = "idle"  # idle | waiting | in_step | dead | done
    inbox: Any = None
    go: Go | None = None


class Sim:
    def __init__(self, replicas: int, min_replicas: int) -> None:
        self.rounds = Rounds(replicas, min_replicas, self.abort, tuple, 60.0, 60.0)
        self.loops = [SimLoop(i) for i in range(replicas)]
        self.aborted: list[int] = []
        self.voted_yes: dict[tuple[int, int], set[int]] = {}

    def abort(self, quorum: int, why: str) -> None:
        self.aborted.append(quorum)

    def responder(self, loop: SimLoop) -> Any:
        incarnation, answered = loop.incarnation, []

        def respond(answer: Any) -> None:
            assert not answered, f"a second answer {answer} to one request of {loop}"
            answered.append(answer)
            if loop.incarnation == incarnation and loop.state != "dead":
                loop.inbox = answer

        return respond

    def can_act(self, loop: SimLoop) -> bool:
        return loop.state in ("idle", "in_step") or (
            loop.state == "waiting" and loop.inbox is not None
        )

    def act(self, loop: SimLoop, ok: bool) -> None:
        if loop.state == "idle":
            loop.state = "waiting"
            request = AskQuorum(loop.index, loop.incarnation, loop.step, UNTIL)
            self.rounds.ask(request, self.responder(loop))
        elif loop.state == "in_step":
            assert loop.go is not None
            loop.state = "waiting"
            if ok:
                self.voted_yes.setdefault((loop.go.quorum, loop.go.step), set()).add(loop.index)
            vote = Vote(loop.index, loop.incarnation, loop.go.quorum, loop.go.step, ok, "no")
            self.rounds.vote(vote, self.responder(loop))
        else:
            answer, loop.inbox = loop.inbox, None
            self.take(loop, answer, ok)

    def take(self, loop: SimLoop, answer: Any, ok: bool) -> None:
        committed = self.rounds.committed_steps
        if isinstance(answer, HealFrom):
            assert answer.step == committed and answer.donors
            loop.step = answer.step if ok else loop.step
            healed = Healed(loop.index, loop.incarnation, loop.step, ok, "heal failed")
            self.rounds.healed(healed, self.responder(loop))
        elif isinstance(answer, Go):
            assert loop.step == answer.step - 1 == committed, "a loop trains on a stale state"
            loop.state, loop.go = "in_step", answer
        elif isinstance(answer, Finished):
            assert loop.step == committed >= UNTIL
            loop.state = "done"
            self.rounds.finished(loop.index)
        elif isinstance(answer, Decision):
            assert loop.go is not None
            if answer.commit:
                loop.step = loop.go.step
            loop.state = "idle"
            if loop.step >= UNTIL:  # its steps() ends: the run returns
                loop.state = "done"
                self.rounds.finished(loop.index)
        else:
            assert isinstance(answer, Retry)
            loop.state = "idle"

    def kill(self, loop: SimLoop) -> None:
        if loop.state not in ("dead", "done"):
            loop.state, loop.inbox = "dead", None
            self.rounds.failed(loop.index, "was killed")

    def respawn(self, loop: SimLoop) -> None:
        if loop.state == "dead":
            loop.incarnation = self.rounds.respawned(loop.index)
            loop.state, loop.step, loop.go = "idle", 0, None

    def settle(self) -> None:
        """Everyone back, nothing fails: every loop must get to the end."""
        for loop in self.loops:
            self.respawn(loop)
        for _ in range(10_000):
            ready = [loop for loop in self.loops if self.can_act(loop)]
            if not ready:
                break
            self.act(ready[0], True)
        stuck = [loop for loop in self.loops if loop.state != "done"]
        assert not stuck, f"stuck: {stuck}, history {self.rounds.history}"

    def check_history(self) -> None:
        history = self.rounds.history
        assert [step for step, _ in history] == list(range(1, len(history) + 1))
        for outcome in self.rounds.outcomes:
            yes = [v for (_, s), v in self.voted_yes.items() if s == outcome.step]
            if outcome.committed:
                assert any(v >= set(outcome.participants) for v in yes), "a step without yes"


actions = st.lists(
    st.tuples(st.sampled_from(["act", "kill", "respawn"]), st.integers(0, 3), st.booleans()),
    max_size=60,
)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.data(), actions)
def test_any_order_of_failures_keeps_the_rules_and_the_run_ends(
    replicas: int, data: st.DataObject, script: list[tuple[str, int, bool]]
) -> None:
    min_replicas = data.draw(st.integers(1, replicas))
    sim = Sim(replicas, min_replicas)
    try:
        for action, index, ok in script:
            loop = sim.loops[index % replicas]
            if action == "kill":
                sim.kill(loop)
            elif action == "respawn":
                sim.respawn(loop)
            elif sim.can_act(loop):
                sim.act(loop, ok or (action == "act" and index % 2 == 0))
        sim.settle()
    except ReplicaGroupError as exc:
        assert "nothing to heal from" in str(exc)
        committed = sim.rounds.committed_steps
        assert committed and not any(
            loop.state != "dead" and loop.step == committed for loop in sim.loops
        ), "the group gave up while a live loop held the committed state"
        return
    sim.check_history()
    assert sim.rounds.committed_steps == UNTIL


def _until_all_in_a_step(sim: Sim) -> None:
    """Ask, heal (all but the seed), and get the first step's group."""
    while True:
        ready = [loop for loop in sim.loops if sim.can_act(loop) and loop.state != "in_step"]
        if not ready:
            break
        sim.act(ready[0], True)


def test_a_no_vote_discards_the_step_and_aborts_its_group() -> None:
    sim = Sim(2, 2)
    _until_all_in_a_step(sim)
    assert all(loop.state == "in_step" for loop in sim.loops)
    sim.act(sim.loops[0], False)
    assert isinstance(sim.loops[0].inbox, Decision) and not sim.loops[0].inbox.commit
    assert sim.aborted == [1]
    sim.act(sim.loops[1], True)  # a late yes gets the same no
    assert sim.loops[1].inbox == sim.loops[0].inbox
    assert sim.rounds.history == []


def test_a_failure_in_a_step_discards_it_for_the_survivors() -> None:
    sim = Sim(3, 2)
    _until_all_in_a_step(sim)
    sim.act(sim.loops[0], True)  # votes yes, waits for the others
    assert sim.loops[0].inbox is None
    sim.kill(sim.loops[2])
    assert isinstance(sim.loops[0].inbox, Decision) and not sim.loops[0].inbox.commit
    assert "replica 2 was killed" in sim.loops[0].inbox.why and sim.aborted == [1]
    sim.settle()
    assert sim.rounds.committed_steps == UNTIL
    assert sim.rounds.loops[2].incarnation == 1


class _PortLike:
    def send(self, value: Any) -> None: ...


def test_bad_requests_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="got str, not a loop's request"):
        parse_request("hello", 2)
    with pytest.raises(ValueError, match="of 2 replicas got a request from 5"):
        parse_request(Envelope(AskQuorum(5, 0, 0, 1), 1, _PortLike()), 2)
    with pytest.raises(ValueError, match="replica 1's request came with no port"):
        parse_request(Envelope(AskQuorum(1, 0, 0, 1), 1, None), 2)
    with pytest.raises(
        ValueError, match="replica 1's AskQuorum has until='9', which is not of type int"
    ):
        parse_request(Envelope(AskQuorum(1, 0, 0, "9"), 1, _PortLike()), 2)  # type: ignore[arg-type]
    good = Envelope(Vote(1, 0, 1, 1, True), 1, _PortLike())
    assert parse_request(good, 2) is good


def test_a_stale_incarnation_or_a_stray_heal_report_gets_a_retry() -> None:
    sim = Sim(2, 1)
    answers: list[Any] = []
    sim.rounds.ask(AskQuorum(0, 3, 0, UNTIL), answers.append)
    sim.rounds.healed(Healed(1, 0, 0, True), answers.append)
    assert [type(a) for a in answers] == [Retry, Retry]
    assert "incarnation 3 is not the current one" in answers[0].why
    assert "was not asked to heal" in answers[1].why
