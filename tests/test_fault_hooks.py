"""The fault-injection hooks: transport fault rules, the mesh fault API, event listeners, and
what host agents do about the sockets and incarnations of procs that died with them.

Three layers, tested with the real thing:

* `transport.NetworkFaults` on its own: a fresh instance and a recording ``send_now`` (no
  sockets), plus the real `Outbox` where the fast path matters.
* `mesh.probe`, `fail_next_call`, `exit_process`, `break_links`, `heal_links` and
  `supervision.add_event_listener`, with real procs running `Fragile` actors.
* daemon host agents (``meshvisor agent`` listening on a private ipc path) for socket
  clean-up and restarts.

This pytest process is a meshvisor client whose fail-fast would interrupt pytest's main thread,
so (as in test_supervision.py) every proc mesh gets a recording ``on_failure`` handler, and an
autouse guard installs a global unhandled-failure hook that records (and so swallows) anything
else; the guard fails the test if an unexpected failure reached it. Waits poll a condition
with a deadline; timings are asserted as lower bounds only.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import failing_actors as fa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polling import wait_gone, wait_until
from recording import Recorder

import mesh.testing
import supervision
from mesh import ActorMesh, ProcMesh, attach, placement
from mesh.testing import (
    break_links,
    exit_process,
    fail_next_call,
    heal_links,
    known_agents,
    probe,
)
from supervision import ActorError, RestartPolicy, SupervisionError, SupervisionEvent
from transport import (
    FaultRule,
    Inbox,
    NetworkFaults,
    Outbox,
    close_context,
    encode,
    message_type,
    network_faults,
    new_context,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_failure_reaches_the_root")]

T = 30.0  # the bound on every wait (never reached when things work)
A, B, C = "ipc:///nowhere/a", "ipc:///nowhere/b", "ipc:///nowhere/c"


class Injected(BaseException):
    """A BaseException that is not an Exception: injected, it fails the actor."""


# -- helpers: the transport layer ---------------------------------------------------------------


class Wire:
    """A fake ``send_now``: records (monotonic time, address, frames as bytes) of every send."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, str, list[bytes]]] = []
        self._lock = threading.Lock()

    def __call__(self, address: str, frames: Sequence[Any]) -> None:
        with self._lock:
            self.sent.append((time.monotonic(), address, [bytes(f) for f in frames]))

    def to(self, address: str) -> list[bytes]:
        """The first frame of every message sent to `address`, in sending order."""
        with self._lock:
            return [frames[0] for _, a, frames in self.sent if a == address]

    def times(self, address: str) -> list[float]:
        with self._lock:
            return [t for t, a, _ in self.sent if a == address]


def numbered(n: int) -> list[bytes]:
    return [str(i).encode() for i in range(n)]


def dropped_indices(seed: int, probability: float, n: int) -> list[int]:
    """Which of `n` messages to A a fresh drop rule with `seed` and `probability` drops."""
    faults, wire = NetworkFaults(), Wire()
    faults.install([FaultRule(frozenset({A}), 60.0, probability=probability, seed=seed)])
    for body in numbered(n):
        faults.route(A, [body], wire)
    delivered = {int(body) for body in wire.to(A)}
    assert faults.dropped == n - len(delivered)
    return [i for i in range(n) if i not in delivered]


def rule(**kwargs: Any) -> FaultRule:
    """A rule on messages to A only."""
    kwargs.setdefault("duration_s", 60.0)
    return FaultRule(frozenset({A}), **kwargs)


# -- helpers: procs -----------------------------------------------------------------------------


@dataclass
class Watched:
    procs: ProcMesh
    recorder: Recorder
    actors: ActorMesh[Any]
    pids: list[int]


def barrier(actors: ActorMesh[Any]) -> None:
    """Wait until the client has handled everything the procs of `actors` sent before now."""

    async def ping() -> None:
        await actors.aping.call()

    anyio.run(ping)


def retry(attempt: Callable[[], Any], timeout: float = T) -> Any:
    """`attempt()` until it returns instead of timing out or failing on a rank being restarted."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return attempt()
        except (TimeoutError, SupervisionError):
            if time.monotonic() > deadline:
                raise
        time.sleep(0.005)


@pytest.fixture
def watched(make_procs: Callable[..., Any]) -> Callable[..., Watched]:
    """Factory: `n` procs with a recording handler and a `Fragile` mesh on them."""

    def make(n: int = 2, name: str = "workers", **kwargs: Any) -> Watched:
        procs = make_procs({"gpus": n}, name=name, **kwargs)
        recorder = Recorder()
        procs.on_failure(recorder)
        actors = procs.spawn(f"{name}-actors", fa.Fragile)
        pids = list(actors.pid.call().get(timeout=T).values())
        return Watched(procs, recorder, actors, pids)

    return make


@pytest.fixture
def healed() -> Iterator[None]:
    """Whatever a test breaks, no fault rule outlives it (here or in the procs)."""
    try:
        yield
    finally:
        heal_links()
        assert network_faults().rules() == []


# == 1. transport fault rules ===================================================================


def test_without_rules_messages_go_at_once() -> None:
    faults, wire = NetworkFaults(), Wire()
    assert not faults.active and faults.rules() == []
    for body in numbered(3):
        faults.route(A, [body, b"payload"], wire)
        assert wire.to(A)[-1] == body  # sent before route() returned
    assert wire.sent[0][2] == [b"0", b"payload"]
    assert faults.dropped == 0 and faults.delayed == 0 and not faults.active


def test_installing_a_rule_makes_the_faults_active() -> None:
    faults = NetworkFaults()
    faults.install([rule(probability=0.5)])
    assert faults.active
    assert faults.rules() == [rule(probability=0.5)]
    faults.install([])  # adding nothing keeps what is there
    assert faults.active and len(faults.rules()) == 1


@settings(max_examples=30, deadline=None, database=None)
@given(seed=st.integers(0, 2**63), probability=st.floats(0.0, 1.0))
def test_the_seed_determines_the_drops(seed: int, probability: float) -> None:
    n = 300
    first = dropped_indices(seed, probability, n)
    assert dropped_indices(seed, probability, n) == first
    if probability == 0.0:
        assert first == []
    if probability == 1.0:
        assert first == list(range(n))


@settings(max_examples=20, deadline=None, database=None)
@given(seeds=st.lists(st.integers(0, 2**63), min_size=2, max_size=2, unique=True))
def test_different_seeds_drop_different_messages(seeds: list[int]) -> None:
    # 256 fair coin flips: two independent streams agree with probability 2**-256.
    assert dropped_indices(seeds[0], 0.5, 256) != dropped_indices(seeds[1], 0.5, 256)


@settings(max_examples=25, deadline=None, database=None)
@given(seed=st.integers(0, 2**63), probability=st.floats(0.0, 1.0))
def test_drops_happen_with_about_the_given_probability(seed: int, probability: float) -> None:
    n = 2000
    rate = len(dropped_indices(seed, probability, n)) / n
    sigma = math.sqrt(probability * (1 - probability) / n)
    assert abs(rate - probability) <= 6 * sigma + 1 / n, (rate, probability)


def test_drops_do_not_depend_on_other_traffic() -> None:
    """One draw per message *to a rule's addresses*: traffic elsewhere does not shift them."""
    alone = dropped_indices(seed=7, probability=0.5, n=200)
    faults, wire = NetworkFaults(), Wire()
    faults.install([rule(probability=0.5, seed=7)])
    for i, body in enumerate(numbered(200)):
        faults.route(A, [body], wire)
        for _ in range(i % 3):
            faults.route(B, [b"other"], wire)
    delivered = {int(body) for body in wire.to(A)}
    assert [i for i in range(200) if i not in delivered] == alone
    assert len(wire.to(B)) == sum(i % 3 for i in range(200))  # none of those dropped


def test_only_the_addresses_of_a_rule_are_affected() -> None:
    faults, wire = NetworkFaults(), Wire()
    faults.install([FaultRule(frozenset({A, B}), 60.0, probability=1.0)])
    for body in numbered(5):
        for address in (A, B, C):
            faults.route(address, [body], wire)
    assert wire.to(A) == [] and wire.to(B) == []
    assert wire.to(C) == numbered(5)  # at once: no delay line involved
    assert faults.dropped == 10 and faults.delayed == 0


def test_delayed_messages_arrive_late_and_in_order() -> None:
    faults, wire = NetworkFaults(), Wire()
    faults.install([rule(delay_s=0.15)])
    routed = []
    for body in numbered(5):
        routed.append(time.monotonic())
        faults.route(A, [body], wire)
        faults.route(B, [b"b" + body], wire)
    assert wire.to(B) == [b"b" + body for body in numbered(5)]  # not delayed
    wait_until(lambda: len(wire.to(A)) == 5, 10, "the delayed messages")
    assert wire.to(A) == numbered(5)
    for sent_at, arrived in zip(routed, wire.times(A)):
        assert arrived - sent_at >= 0.15
    assert faults.delayed == 5 and faults.dropped == 0


def test_the_longest_delay_of_matching_rules_applies() -> None:
    faults, wire = NetworkFaults(), Wire()
    faults.install([rule(delay_s=0.05), FaultRule(frozenset({A, B}), 60.0, delay_s=0.3)])
    start = time.monotonic()
    faults.route(A, [b"a"], wire)
    wait_until(lambda: wire.to(A), 10, "the delayed message")
    assert wire.times(A)[0] - start >= 0.3


def test_fifo_holds_when_a_delay_rule_expires_with_messages_queued() -> None:
    faults, wire = NetworkFaults(), Wire()
    faults.install([rule(delay_s=1.0, duration_s=0.05)])
    installed = time.monotonic()
    faults.route(A, [b"0"], wire)
    wait_until(lambda: time.monotonic() > installed + 0.1, 5, "the rule to expire")
    assert wire.to(A) == [], "the machine stalled: the delayed message left already"
    faults.route(A, [b"1"], wire)  # no rule applies any more, but 0 is still queued
    faults.route(B, [b"b"], wire)
    assert wire.to(B) == [b"b"]  # nothing queued for B: at once
    assert faults.rules() == []  # the expired rule is gone...
    assert faults.active  # ...but sends stay on the slow path while messages are queued
    wait_until(lambda: len(wire.to(A)) == 2, 10, "both messages to A")
    assert wire.to(A) == [b"0", b"1"]
    wait_until(lambda: not faults.active, 5, "the fast path once the queue is empty")
    assert wire.times(A)[0] - installed >= 1.0


def test_fifo_holds_across_clear_and_a_shorter_delay() -> None:
    faults, wire = NetworkFaults(), Wire()
    faults.install([rule(delay_s=1.0)])
    start = time.monotonic()
    faults.route(A, [b"0"], wire)
    faults.clear()
    assert faults.rules() == [] and faults.active  # 0 is still queued
    faults.route(A, [b"1"], wire)  # no rule: still behind 0
    faults.install([rule(delay_s=0.01)])
    faults.route(A, [b"2"], wire)  # a shorter delay: still behind 1
    assert wire.to(A) == [], "the machine stalled: the delayed message left already"
    wait_until(lambda: len(wire.to(A)) == 3, 10, "the three messages")
    assert wire.to(A) == [b"0", b"1", b"2"]
    assert min(wire.times(A)) - start >= 1.0


def test_hold_keeps_messages_until_the_rule_ends_then_sends_them_in_order() -> None:
    faults, wire = NetworkFaults(), Wire()
    installed = time.monotonic()  # before: the rule's 0.4 s count from inside install()
    faults.install([rule(hold=True, duration_s=0.4)])
    for body in numbered(4):
        faults.route(A, [body], wire)
    faults.route(B, [b"b"], wire)
    assert wire.to(B) == [b"b"] and wire.to(A) == []
    wait_until(lambda: len(wire.to(A)) == 4, 10, "the held messages")
    assert wire.to(A) == numbered(4)
    assert min(wire.times(A)) - installed >= 0.4
    assert faults.dropped == 0


def test_rules_expire_after_their_duration() -> None:
    faults, wire = NetworkFaults(), Wire()
    faults.install([rule(probability=1.0, duration_s=0.2)])
    installed = time.monotonic()
    faults.route(A, [b"0"], wire)
    assert wire.to(A) == [] and faults.dropped == 1
    wait_until(lambda: time.monotonic() > installed + 0.2, 5, "the rule to expire")
    faults.route(A, [b"1"], wire)
    assert wire.to(A) == [b"1"]  # at once, not dropped
    assert not faults.active and faults.rules() == []


def test_clear_removes_every_rule() -> None:
    faults, wire = NetworkFaults(), Wire()
    faults.install([rule(probability=1.0), FaultRule(frozenset({B}), 60.0, delay_s=5.0)])
    faults.clear()
    assert not faults.active and faults.rules() == []
    faults.route(A, [b"a"], wire)
    faults.route(B, [b"b"], wire)
    assert wire.to(A) == [b"a"] and wire.to(B) == [b"b"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"probability": 1.5},
        {"probability": -0.1},
        {"probability": math.nan},
        {"duration_s": -1.0},
        {"delay_s": -0.5},
    ],
)
def test_invalid_rules_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        rule(**kwargs)


def test_boundary_rules_are_valid() -> None:
    for kwargs in ({"probability": 0.0}, {"probability": 1.0}, {"duration_s": 0.0}):
        rule(**kwargs)


def test_delayed_frames_are_snapshots() -> None:
    faults, wire = NetworkFaults(), Wire()
    faults.install([rule(delay_s=0.05)])
    buffer = bytearray(b"original")
    faults.route(A, [buffer, memoryview(bytearray(b"view"))], wire)
    buffer[:] = b"changed!"
    wait_until(lambda: wire.sent, 10, "the delayed message")
    assert wire.sent[0][2] == [b"original", b"view"]


def test_a_late_delay_line_is_not_overtaken() -> None:
    faults = NetworkFaults()
    sent: list[bytes] = []
    sending_first, release = threading.Event(), threading.Event()

    def send_now(address: str, frames: Sequence[Any]) -> None:
        sent.append(bytes(frames[0]))
        if frames[0] == b"0":  # a slow send: the delay line is busy with the first message
            sending_first.set()
            release.wait(10)

    try:
        faults.install([rule(delay_s=0.1, duration_s=0.1)])
        installed = time.monotonic()
        faults.route(A, [b"0"], send_now)
        faults.route(A, [b"1"], send_now)
        wait_until(sending_first.is_set, 10, "the delay line to send the first message")
        wait_until(lambda: time.monotonic() > installed + 0.15, 5, "the rule to expire")
        faults.route(A, [b"2"], send_now)  # 1 is still queued
    finally:
        release.set()
    wait_until(lambda: len(sent) == 3, 10, "the three messages")
    assert sent == [b"0", b"1", b"2"]


@message_type
@dataclass(frozen=True, slots=True)
class _Numbered:
    n: int


@pytest.mark.parametrize("how", ["clear", "expiry"])
def test_outbox_keeps_fifo_after_the_rules_end(how: str) -> None:
    faults = network_faults()  # the one Outbox consults
    assert faults.rules() == []
    folder = tempfile.mkdtemp(prefix="fh-", dir=os.environ["XDG_RUNTIME_DIR"])
    context = new_context()
    inbox = Inbox(context, f"ipc://{folder}/in")
    outbox = Outbox(context)
    received: list[int] = []
    try:
        target = frozenset({inbox.address})
        if how == "clear":
            faults.install([FaultRule(target, 60.0, delay_s=0.5)])
            outbox.send(inbox.address, encode(_Numbered(0)))
            faults.clear()
            outbox.send(inbox.address, encode(_Numbered(1)))
            expected = [0, 1]
        else:
            faults.install([FaultRule(target, 0.05, delay_s=0.5)])
            installed = time.monotonic()
            outbox.send(inbox.address, encode(_Numbered(0)))
            wait_until(lambda: time.monotonic() > installed + 0.1, 5, "the rule to expire")
            outbox.send(inbox.address, encode(_Numbered(1)))  # prunes the rule; queued
            outbox.send(inbox.address, encode(_Numbered(2)))
            expected = [0, 1, 2]

        def receive() -> bool:
            while (envelope := inbox.receive_nowait()) is not None:
                received.append(envelope.header.n)
            return len(received) == len(expected)

        wait_until(receive, 10, "every message")
        assert received == expected
    finally:
        faults.clear()
        outbox.close(linger_ms=0)
        inbox.close()
        close_context(context)
        shutil.rmtree(folder, ignore_errors=True)


# == 2. the mesh fault API ======================================================================


def test_probe_answers_pids_and_fails_for_a_killed_rank(watched: Callable[..., Watched]) -> None:
    w = watched()
    pids = probe(w.actors).get(timeout=T)
    assert pids.values() == tuple(w.pids) == w.actors.pid.call().get(timeout=T).values()
    assert probe(w.actors.slice(gpus=1)).get(timeout=T).values() == (w.pids[1],)
    os.kill(w.pids[1], signal.SIGKILL)
    (event,) = w.recorder.wait(1)
    assert event.kind == "signal" and event.pid == w.pids[1]
    with pytest.raises(SupervisionError) as info:
        probe(w.actors).get(timeout=T)
    assert info.value.event.kind == "signal"
    with pytest.raises(SupervisionError):
        probe(w.actors.slice(gpus=1)).get(timeout=T)
    assert probe(w.actors.slice(gpus=0)).get(timeout=T).values() == (w.pids[0],)


def test_placement_follows_the_procs_of_a_mesh(watched: Callable[..., Watched]) -> None:
    w = watched()
    where = placement(w.actors)
    assert [p.rank for p in where] == [0, 1]
    assert [p.pid for p in where] == w.pids
    assert {p.state for p in where} == {"ready"}
    assert len({p.proc_id for p in where}) == 2 and all(p.agent for p in where)
    assert [p.pid for p in placement(w.actors.slice(gpus=1))] == [w.pids[1]]
    os.kill(w.pids[1], signal.SIGKILL)
    w.recorder.wait(1)
    assert [p.state for p in placement(w.actors)] == ["ready", "failed"]


def test_fail_next_call_fails_one_call_of_one_endpoint(watched: Callable[..., Watched]) -> None:
    w = watched()
    rank0 = w.actors.slice(gpus=0)
    assert fail_next_call(rank0, ValueError("x marks the spot"), "ping").get(
        timeout=T
    ).values() == (None,)
    # other endpoints of that rank, and the other rank, are unaffected
    assert rank0.pid.call_one().get(timeout=T) == w.pids[0]
    assert w.actors.slice(gpus=1).pid.call_one().get(timeout=T) == w.pids[1]
    assert w.actors.slice(gpus=1).ping.call_one().get(timeout=T) == 0  # ranks of the slice
    with pytest.raises(ActorError) as info:
        rank0.ping.call_one().get(timeout=T)
    assert isinstance(info.value, ValueError)
    assert not isinstance(info.value, SupervisionError)
    assert "x marks the spot" in str(info.value)
    assert dict(info.value.rank or {}) == {"gpus": 0}
    assert rank0.ping.call_one().get(timeout=T) == 0  # only once
    assert w.actors.ping.call().get(timeout=T).values() == (0, 1)
    # two pings ran on rank 0 (the failed one never reached the endpoint)
    assert rank0.count.call_one().get(timeout=T) == 2
    barrier(w.actors)
    assert w.recorder.events == []


def test_fail_next_call_without_endpoint_fails_whatever_comes_next(
    watched: Callable[..., Watched],
) -> None:
    w = watched()
    fail_next_call(w.actors, KeyError("armed"), None).get(timeout=T)
    # the built-in probe does not consume the injected failure
    assert probe(w.actors).get(timeout=T).values() == tuple(w.pids)
    with pytest.raises(KeyError) as info:
        w.actors.slice(gpus=0).pid.call_one().get(timeout=T)
    assert isinstance(info.value, ActorError)
    with pytest.raises(KeyError):
        w.actors.slice(gpus=1).aping.call_one().get(timeout=T)
    assert w.actors.pid.call().get(timeout=T).values() == tuple(w.pids)
    assert w.actors.aping.call().get(timeout=T).values() == (0, 1)
    barrier(w.actors)
    assert w.recorder.events == []


def test_fail_next_call_with_a_base_exception_fails_the_actor(
    watched: Callable[..., Watched],
) -> None:
    w = watched()
    rank1 = w.actors.slice(gpus=1)
    fail_next_call(rank1, Injected("injected and fatal"), "ping").get(timeout=T)
    assert rank1.pid.call_one().get(timeout=T) == w.pids[1]  # other endpoints: not yet
    with pytest.raises(SupervisionError) as first:
        rank1.ping.call_one().get(timeout=T)
    assert not isinstance(first.value, ActorError)
    (event,) = w.recorder.wait(1)
    assert event.kind == "exception" and event.pid == w.pids[1]
    assert dict(event.rank or {}) == {"gpus": 1}
    assert "Injected" in event.message and "injected and fatal" in event.message
    with pytest.raises(SupervisionError) as later:
        rank1.ping.call_one().get(timeout=T)
    assert later.value.event.kind == "exception"
    with pytest.raises(SupervisionError):
        probe(rank1).get(timeout=T)
    assert w.actors.slice(gpus=0).ping.call_one().get(timeout=T) == 0
    barrier(w.actors.slice(gpus=0))
    assert len(w.recorder.events) == 1


def test_exit_process_exits_with_the_code(watched: Callable[..., Watched]) -> None:
    w = watched()
    exit_process(w.actors.slice(gpus=1), 7)
    (event,) = w.recorder.wait(1)
    assert event.kind == "exit" and event.exit_code == 7
    assert event.pid == w.pids[1] and dict(event.rank or {}) == {"gpus": 1}
    wait_gone([w.pids[1]])
    with pytest.raises(SupervisionError) as info:
        w.actors.slice(gpus=1).ping.call_one().get(timeout=T)
    assert info.value.event.exit_code == 7
    assert w.actors.slice(gpus=0).ping.call_one().get(timeout=T) == 0


def test_break_links_drops_during_the_window_only(
    watched: Callable[..., Watched], healed: None
) -> None:
    w = watched()
    rank1 = w.actors.slice(gpus=1)
    duration = 2.0
    start = time.monotonic()
    break_links("client", rank1, duration_s=duration, probability=1.0)
    assert network_faults().active
    with pytest.raises(TimeoutError):
        rank1.ping.call_one().get(timeout=0.3)
    assert w.actors.slice(gpus=0).ping.call_one().get(timeout=T) == 0
    assert time.monotonic() < start + duration, "the machine stalled past the window"
    wait_until(lambda: time.monotonic() > start + duration, T, "the window to end")
    assert retry(lambda: rank1.pid.call_one().get(timeout=1.0), timeout=10) == w.pids[1]
    assert w.actors.ping.call().get(timeout=T).values() == (0, 1)
    barrier(w.actors)
    assert w.recorder.events == []


def test_break_links_delays_both_ways(watched: Callable[..., Watched], healed: None) -> None:
    w = watched()
    rank1 = w.actors.slice(gpus=1)
    break_links("client", rank1, duration_s=20.0, delay_s=0.2)
    start = time.monotonic()
    assert rank1.pid.call_one().get(timeout=T) == w.pids[1]
    assert time.monotonic() - start >= 0.35  # 0.2 s out and 0.2 s back
    assert w.actors.slice(gpus=0).ping.call_one().get(timeout=T) == 0
    assert w.recorder.events == []


def test_break_links_hold_delivers_after_the_cut(
    watched: Callable[..., Watched], healed: None
) -> None:
    w = watched()
    rank1 = w.actors.slice(gpus=1)
    start = time.monotonic()
    break_links("client", rank1, duration_s=0.5, hold=True)
    held = rank1.pid.call_one()
    assert w.actors.slice(gpus=0).ping.call_one().get(timeout=T) == 0
    assert held.get(timeout=T) == w.pids[1]  # not lost
    assert time.monotonic() - start >= 0.45
    assert rank1.pid.call_one().get(timeout=T) == w.pids[1]
    assert w.recorder.events == []


def test_heal_links_ends_a_drop_window_early(watched: Callable[..., Watched], healed: None) -> None:
    w = watched()
    rank1 = w.actors.slice(gpus=1)
    start = time.monotonic()
    break_links("client", rank1, duration_s=60.0, probability=1.0)
    with pytest.raises(TimeoutError):
        rank1.ping.call_one().get(timeout=0.3)
    heal_links()
    assert not network_faults().active and network_faults().rules() == []
    assert retry(lambda: rank1.pid.call_one().get(timeout=1.0), timeout=10) == w.pids[1]
    assert time.monotonic() - start < 30
    barrier(w.actors)
    assert w.recorder.events == []


def test_break_links_refuses_bad_arguments(watched: Callable[..., Watched], healed: None) -> None:
    w = watched(1)
    with pytest.raises(ValueError, match="probability, a delay or hold"):
        break_links("client", w.actors, duration_s=1.0)
    with pytest.raises(ValueError, match="unknown party"):
        break_links("nobody", w.actors, duration_s=1.0, probability=0.5)
    with pytest.raises(ValueError, match="unknown party"):
        break_links(w.actors, "server", duration_s=1.0, probability=0.5)
    with pytest.raises(ValueError):
        break_links("client", w.actors, duration_s=1.0, probability=1.5)
    with pytest.raises(ValueError):
        break_links("client", w.actors, duration_s=-1.0, delay_s=0.1)
    assert network_faults().rules() == [] and not network_faults().active
    assert w.actors.ping.call().get(timeout=T).values() == (0,)  # nothing was broken


def test_event_listeners_see_restarted_failures_once_each(make_procs: Callable[..., Any]) -> None:
    kept: list[SupervisionEvent] = []
    dropped: list[SupervisionEvent] = []
    remove_kept = supervision.add_event_listener(kept.append)
    remove_dropped = supervision.add_event_listener(dropped.append)
    try:
        policy = RestartPolicy(max_restarts=5, within_s=10)
        procs = make_procs({"gpus": 2}, name="restarting", restart=policy)
        recorder = Recorder()
        procs.on_failure(recorder)
        rank1 = procs.spawn("restarting-actors", fa.Fragile).slice(gpus=1)
        killed = [rank1.pid.call_one().get(timeout=T)]
        for _ in range(2):
            os.kill(killed[-1], signal.SIGKILL)
            killed.append(retry(lambda: _new_pid(rank1, killed[-1])))
            # the listener ran before the restart was decided, so it is there by now
            assert [(e.kind, e.pid) for e in kept] == [("signal", pid) for pid in killed[:-1]]
            remove_dropped()  # after the first failure
            remove_dropped()  # a second removal is harmless
        assert [(e.kind, e.pid) for e in dropped] == [("signal", killed[0])]
        assert all(dict(e.rank or {}) == {"gpus": 1} for e in kept)
        assert recorder.events == [], "the restart policy handled both failures"
        assert remove_dropped not in supervision.event_listeners()
    finally:
        remove_kept()
        remove_dropped()
    assert kept.append not in supervision.event_listeners()
    assert dropped.append not in supervision.event_listeners()


def _new_pid(actors: ActorMesh[Any], old: int) -> int:
    pid = int(actors.pid.call_one().get(timeout=1.0))
    if pid == old:
        raise TimeoutError("not restarted yet")
    return pid


def test_a_raising_listener_is_logged_and_does_not_break_supervision(
    make_procs: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    order: list[tuple[str, str]] = []

    def broken(event: SupervisionEvent) -> None:
        raise RuntimeError("listener went boom")

    def handler(event: SupervisionEvent) -> bool:
        order.append(("handler", event.kind))
        return True

    removers = [
        supervision.add_event_listener(broken),
        supervision.add_event_listener(lambda e: order.append(("listener", e.kind))),
    ]
    try:
        procs = make_procs({"gpus": 2}, name="listened")
        procs.on_failure(handler)
        actors = procs.spawn("listened-actors", fa.Fragile)
        pids = list(actors.pid.call().get(timeout=T).values())
        os.kill(pids[1], signal.SIGKILL)
        wait_until(lambda: ("handler", "signal") in order, T, "the handler to run")
        assert order == [("listener", "signal"), ("handler", "signal")]
        with pytest.raises(SupervisionError):
            actors.slice(gpus=1).ping.call_one().get(timeout=T)
        assert actors.slice(gpus=0).ping.call_one().get(timeout=T) == 0
    finally:
        for remove in removers:
            remove()
    err = capsys.readouterr().err
    assert "event_listener_raised" in err and "listener went boom" in err


# == 3. daemon host agents ======================================================================


class DaemonAgent:
    """A ``meshvisor agent`` daemon on a stable ipc address in a private folder; it can be
    SIGKILLed and started again on the same address and run directory."""

    def __init__(self) -> None:
        # conftest's RUN_BASE; not imported from conftest, because procs import this module
        # (to unpickle `Injected`) and importing conftest there would make a directory
        base = os.environ["XDG_RUNTIME_DIR"]
        self.folder = Path(tempfile.mkdtemp(prefix="fh-", dir=base))
        self.rundir = self.folder / "run"
        self.rundir.mkdir(mode=0o700)
        self.address = f"ipc://{self.rundir}/agent"
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, *options: str) -> str:
        """Start the agent (again), with these extra ``meshvisor agent`` options."""
        address_file = self.folder / f"address{len(self.started)}"
        self.started.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "meshvisor",
                    "agent",
                    "--listen",
                    self.address,
                    "--rundir",
                    str(self.rundir),
                    "--address-file",
                    str(address_file),
                    *options,
                ]
            )
        )
        wait_until(address_file.exists, T, "the agent to listen")
        assert address_file.read_text().strip() == self.address
        return self.address

    def kill(self) -> None:
        agent = self.started[-1]
        agent.kill()
        agent.wait(T)

    def sockets(self) -> set[str]:
        """The names of the unix sockets in the run directory."""
        found = set()
        for entry in os.scandir(self.rundir):
            try:
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    found.add(entry.name)
            except FileNotFoundError:
                pass
        return found

    def close(self) -> None:
        for agent in self.started:
            if agent.poll() is None:
                agent.terminate()
        for agent in self.started:
            try:
                agent.wait(T)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(T)
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def make_daemon() -> Iterator[Callable[[], DaemonAgent]]:
    """Factory of daemon agents (not started); each is stopped and its folder removed after."""
    made: list[DaemonAgent] = []

    def make() -> DaemonAgent:
        made.append(DaemonAgent())
        return made[-1]

    try:
        yield make
    finally:
        for agent in made:
            agent.close()


@pytest.fixture
def daemon(make_daemon: Callable[[], DaemonAgent]) -> DaemonAgent:
    return make_daemon()


def incarnation_known(address: str) -> bool:
    """Whether this client has heard an AgentAlive (with its incarnation) from `address`."""
    return address in known_agents()


def _of(proc_id: str | None, names: set[str]) -> set[str]:
    """The socket names of proc `proc_id` among `names` (its inbox and reply inboxes)."""
    assert proc_id
    return {n for n in names if n == proc_id or n.startswith(f"{proc_id}-r")}


def test_agent_removes_the_sockets_of_procs_that_died(daemon: DaemonAgent) -> None:
    hosts = attach([daemon.start()])
    procs = hosts.spawn_procs(per_host={"gpus": 3}, name="sockets")
    try:
        recorder = Recorder()
        procs.on_failure(recorder)
        actors = procs.spawn("sockets-actors", fa.Fragile)
        pids = list(actors.pid.call().get(timeout=T).values())
        before = daemon.sockets()
        assert "agent" in before and len(before) >= 4, before
        os.kill(pids[0], signal.SIGKILL)  # it cannot remove its own socket
        (killed,) = recorder.wait(1)
        assert killed.kind == "signal" and _of(killed.proc_id, before)
        wait_until(lambda: not _of(killed.proc_id, daemon.sockets()), T, "the killed proc's socket")
        exit_process(actors.slice(hosts=0, gpus=1), 0)  # exits at once, no clean-up either
        exited = recorder.wait(2)[1]
        assert exited.kind == "exit" and exited.exit_code == 0 and _of(exited.proc_id, before)
        wait_until(lambda: not _of(exited.proc_id, daemon.sockets()), T, "the exited proc's socket")
        assert daemon.sockets() == before - _of(killed.proc_id, before) - _of(
            exited.proc_id, before
        )
        assert actors.slice(hosts=0, gpus=2).pid.call_one().get(timeout=T) == pids[2]
        procs.stop().get(timeout=T)  # the last one stops when asked
        wait_until(lambda: daemon.sockets() == {"agent"}, T, "only the agent's socket")
    finally:
        procs.stop().get(timeout=T)


def test_a_restarted_agent_reports_its_old_procs_unreachable(daemon: DaemonAgent) -> None:
    # Silence alone must not tell: only the new incarnation's first AgentAlive can.
    with mesh.testing.settings(agent_timeout_s=600.0):
        _check_a_restarted_agent_reports_its_old_procs_unreachable(daemon)


def _check_a_restarted_agent_reports_its_old_procs_unreachable(daemon: DaemonAgent) -> None:
    hosts = attach([daemon.start()])
    procs = hosts.spawn_procs(per_host={"gpus": 2}, name="incarnation")
    again: ProcMesh | None = None
    try:
        recorder = Recorder()
        procs.on_failure(recorder)
        actors = procs.spawn("incarnation-actors", fa.Fragile)
        pids = list(actors.pid.call().get(timeout=T).values())
        # The client greets a newly attached agent at once; wait for its answer.
        wait_until(lambda: incarnation_known(daemon.address), T, "the agent's first AgentAlive")
        old_sockets = daemon.sockets() - {"agent"}
        assert len(old_sockets) >= 2, old_sockets
        daemon.kill()
        wait_gone(pids)  # the procs die with their agent
        assert old_sockets <= daemon.sockets(), "killed procs leave their sockets behind"
        daemon.start()
        started = time.monotonic()
        # the new agent removed the old incarnation's sockets before it listened
        assert daemon.sockets() == {"agent"}
        events = recorder.wait(2, timeout=5.0)
        assert time.monotonic() - started < 5.0
        assert [e.kind for e in events] == ["unreachable", "unreachable"]
        assert sorted(e.pid for e in events if e.pid is not None) == sorted(pids)
        assert sorted(dict(e.rank or {})["gpus"] for e in events) == [0, 1]
        assert all("restarted" in e.message for e in events), events
        with pytest.raises(SupervisionError, match="unreachable"):
            actors.ping.call().get(timeout=T)
        # the same host serves new procs
        again = hosts.spawn_procs(per_host={"gpus": 2}, name="again")
        again.on_failure(recorder)
        fresh = again.spawn("again-actors", fa.Fragile)
        assert fresh.ping.call().get(timeout=T).values() == (0, 1)
        assert not set(fresh.pid.call().get(timeout=T).values()) & set(pids)
        barrier(fresh)
        assert len(recorder.events) == 2
    finally:
        if again is not None:
            again.stop().get(timeout=T)
        procs.stop().get(timeout=T)


def test_an_agent_started_where_one_was_shut_down_is_watched_like_any_other(
    daemon: DaemonAgent,
) -> None:
    """A client that shut an agent down (its exit is no failure) and then uses a new agent at
    the same address (a SLURM job after another, a port reused) still hears of its loss."""
    with mesh.testing.settings(agent_timeout_s=1.0):
        hosts = attach([daemon.start()])
        hosts.shutdown()
        daemon.started[-1].wait(T)
        time.sleep(2.5)  # past the timeout: the client forgets the agent it stopped
        hosts = attach([daemon.start()])
        procs = hosts.spawn_procs(per_host={"gpus": 1}, name="reused")
        try:
            recorder = Recorder()
            procs.on_failure(recorder)
            pid = procs.spawn("reused-actors", fa.Fragile).pid.call_one().get(timeout=T)
            wait_until(lambda: incarnation_known(daemon.address), T, "the agent's AgentAlive")
            daemon.kill()
            wait_gone([pid])
            (event,) = recorder.wait(1, timeout=T)
            assert event.kind == "unreachable" and event.pid == pid, event
            assert "gave no answer" in event.message, event  # not "was shut down"
        finally:
            procs.stop().get(timeout=T)


def test_a_silent_agent_is_greeted_ever_less_often_and_seen_when_it_is_back(
    daemon: DaemonAgent,
) -> None:
    """A lost (not stopped) agent is greeted with growing pauses, not every tick for the
    client's whole life; a request to it greets it at once, so its return is still seen."""
    with mesh.testing.settings(agent_timeout_s=0.5, owner_alive_interval_s=0.05):
        hosts = attach([daemon.start()])
        procs = hosts.spawn_procs(per_host={"gpus": 1}, name="silent")
        again: ProcMesh | None = None
        agent = daemon.started[-1]
        try:
            recorder = Recorder()
            procs.on_failure(recorder)
            procs.spawn("silent-actors", fa.Fragile).ping.call_one().get(timeout=T)
            agent.send_signal(signal.SIGSTOP)
            (event,) = recorder.wait(1, timeout=T)
            assert event.kind == "unreachable" and "gave no answer" in event.message, event
            before = mesh.testing.greetings_sent(daemon.address)
            time.sleep(3.0)
            during = mesh.testing.greetings_sent(daemon.address) - before
            # every tick (0.05 s) would be ~60; pauses of half the silence leave a handful
            assert 1 <= during <= 12, during
            agent.send_signal(signal.SIGCONT)
            again = hosts.spawn_procs(per_host={"gpus": 1}, name="back")
            again.on_failure(recorder)
            assert again.spawn("back-actors", fa.Fragile).ping.call_one().get(timeout=T) == 0
        finally:
            agent.send_signal(signal.SIGCONT)
            if again is not None:
                again.stop().get(timeout=T)
            procs.stop().get(timeout=T)


WATCHING_OWNER = textwrap.dedent("""
    import sys, time
    import mesh
    mesh.configure(agent_timeout_s={timeout!r}, owner_alive_interval_s=0.1)
    from mesh import attach
    from mesh.testing import known_agents

    events = []
    procs = attach([{agent!r}]).spawn_procs(per_host={{"gpus": 1}})
    procs.on_failure(lambda event: events.append(event) or True)
    ends = time.monotonic() + 30
    while {agent!r} not in known_agents():  # it answered a greeting
        if time.monotonic() > ends:
            sys.exit("the agent never answered a greeting")
        time.sleep(0.01)
    print("READY", flush=True)
    sys.stdin.readline()  # told to go on (it may have been stopped meanwhile)
    time.sleep({pause_s!r})  # its agent has time to answer, or be lost
    print("EVENTS", *[event.kind for event in events], flush=True)
    procs.stop().get(timeout=30)
""")


def _start_watching_owner(
    daemon: DaemonAgent, timeout: float, pause_s: float
) -> subprocess.Popen[str]:
    """A client process owning a proc on `daemon`'s agent (its agent timeout `timeout`), ready
    (its agent answered); told to go on, it waits `pause_s`, then prints the events it got."""
    address = daemon.start("--owner-timeout", "60")  # the agent keeps a stopped owner's procs
    home = daemon.folder / "h"  # short: a longer XDG_RUNTIME_DIR is ignored
    home.mkdir(mode=0o700)
    script = daemon.folder / "owner.py"
    script.write_text(WATCHING_OWNER.format(timeout=timeout, agent=address, pause_s=pause_s))
    owner = subprocess.Popen(
        [sys.executable, str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "XDG_RUNTIME_DIR": str(home)},
    )
    try:  # the script ends its own wait for the agent: its line (or its end) comes
        ready = owner.stdout.readline().split()  # type: ignore[union-attr]
    except BaseException:  # a pytest timeout: the owner is not left behind
        owner.kill()
        raise
    if ready != ["READY"]:
        owner.kill()
        owner.communicate()
        pytest.fail(f"the owner script failed: {ready}")
    return owner


def test_an_owner_stopped_longer_than_the_agent_timeout_keeps_its_healthy_agent(
    daemon: DaemonAgent,
) -> None:
    """Silence counts only while the owner was there to greet and listen: an owner stopped
    (or starved of CPU on a busy host) past agent_timeout_s finds its agent alive on return."""
    timeout = 2.0
    owner = _start_watching_owner(daemon, timeout, pause_s=timeout * 1.5)
    try:
        owner.send_signal(signal.SIGSTOP)
        time.sleep(timeout * 1.5)
        owner.send_signal(signal.SIGCONT)
        out, _ = owner.communicate("go\n", timeout=T)
        assert out.split() == ["EVENTS"], out
    finally:
        owner.kill()
        owner.wait(T)


GONE_OWNER = textwrap.dedent("""
    from mesh import attach
    attach([{agent!r}]).spawn_procs(per_host={{"gpus": 1}}).stop().get(timeout=30)
""")


def test_an_idle_agent_stops_at_once_on_sigterm(daemon: DaemonAgent) -> None:
    """SIGTERM wakes the agent's wait: an idle agent whose owner left (its next deadline that
    owner's timeout, 60 s here) used to notice it only when that deadline came."""
    address = daemon.start("--owner-timeout", "60")
    home = daemon.folder / "h"  # short: a longer XDG_RUNTIME_DIR is ignored
    home.mkdir(mode=0o700)
    script = daemon.folder / "owner.py"
    script.write_text(GONE_OWNER.format(agent=address))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(home)}
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=T)
    agent = daemon.started[-1]
    agent.terminate()
    assert agent.wait(10.0) == 0


def test_an_owner_starved_on_every_tick_still_reports_a_dead_agent(daemon: DaemonAgent) -> None:
    """Forgiving the owner's own absences is bounded: an owner stopped again and again (each
    tick late) still reports an agent that stopped answering (here SIGSTOPped)."""
    timeout = 1.0
    owner = _start_watching_owner(daemon, timeout, pause_s=0.0)
    agent = daemon.started[-1]
    try:
        agent.send_signal(signal.SIGSTOP)
        ends = time.monotonic() + 12 * timeout  # past the most forgiven (5) and one timeout
        while time.monotonic() < ends:
            owner.send_signal(signal.SIGSTOP)
            time.sleep(0.7)  # every tick of the owner comes past OWN_PAUSE_S late
            owner.send_signal(signal.SIGCONT)
            time.sleep(0.05)
        owner.send_signal(signal.SIGSTOP)
        assert owner.stdin is not None
        owner.stdin.write("go\n")
        owner.stdin.flush()
        owner.send_signal(signal.SIGCONT)
        out = owner.stdout.readline().split()  # type: ignore[union-attr]
        assert out[:1] == ["EVENTS"] and "unreachable" in out, out
    finally:
        agent.send_signal(signal.SIGCONT)
        owner.send_signal(signal.SIGCONT)
        owner.kill()
        owner.wait(T)
        for pipe in (owner.stdin, owner.stdout):
            if pipe is not None:
                pipe.close()


INCARNATION_CLIENT = textwrap.dedent("""
    import os, signal, sys, time
    import mesh
    # Widen the window (the owner says it is alive every 0.5 s by default); only the new
    # incarnation can tell, not silence.
    mesh.configure(owner_alive_interval_s={interval!r}, agent_timeout_s=600.0)
    from mesh import Actor, attach, endpoint
    from mesh.testing import known_agents

    class Pid(Actor):
        @endpoint
        def pid(self):
            return os.getpid()

    events = []
    attach([{first!r}])  # starts the keep-alive loop: the first tick goes out at once
    while {first!r} not in known_agents():  # the first tick was answered
        time.sleep(0.001)
    attached = time.monotonic()
    procs = attach([{second!r}]).spawn_procs(per_host={{"gpus": 1}})
    procs.on_failure(lambda event: events.append(event) or True)
    pid = procs.spawn("p", Pid).pid.call_one().get(timeout=30)
    os.kill({agent_pid}, signal.SIGKILL)
    print("KILLED", pid, time.monotonic() - attached, flush=True)
    sys.stdin.readline()  # the agent was started again
    deadline = max(attached + {interval} + 2.0, time.monotonic() + 2.0)
    while not events and time.monotonic() < deadline:
        time.sleep(0.01)
    print("EVENTS", *[event.kind for event in events], flush=True)
    os._exit(0)
""")


def test_an_agent_restarted_before_its_first_answer_is_noticed(
    make_daemon: Callable[[], DaemonAgent],
) -> None:
    first, second = make_daemon(), make_daemon()
    first.start()
    second.start()
    interval = 3.0
    home = first.folder / "h"  # short: a longer XDG_RUNTIME_DIR is ignored
    home.mkdir(mode=0o700)
    script = first.folder / "client.py"
    script.write_text(
        INCARNATION_CLIENT.format(
            interval=interval,
            first=first.address,
            second=second.address,
            agent_pid=second.started[-1].pid,
        )
    )
    client = subprocess.Popen(
        [sys.executable, str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "XDG_RUNTIME_DIR": str(home)},
    )
    try:
        killed = client.stdout.readline().split()  # type: ignore[union-attr]
        if killed[:1] != ["KILLED"]:
            pytest.fail(f"the client script failed: {killed}")
        if float(killed[2]) >= interval:
            pytest.fail("the premise does not hold: the agent outlived the client's next tick")
        second.started[-1].wait(T)
        wait_gone([int(killed[1])])
        second.start()
        out, _ = client.communicate("go\n", timeout=T)
        assert out.split() == ["EVENTS", "unreachable"]
    finally:
        client.kill()
        client.wait(T)
