"""A large argument fanned out to several procs of one host travels once: into a slot of the
agent's payload arena, which procs map once (`mesh/_engine/payload_arena.py`), or for the
largest into a memory file of its own (`mesh/_engine/shared_payload.py`). Every rank gets it
intact, a write by one rank stays its own, and the slot or file is let go once every
recipient answered or died."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import shared_payload_actors as spa
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polling import wait_until

import mesh.testing
from mesh.testing import arena_wire, fail_next_call, fan_out_from, fanned_out, wire
from mesh.testing import shared_payload_wire as sp
from supervision import ActorError, SupervisionError
from transport import Payload

T = 30  # seconds: the bound on every wait in this module (never reached when things work)
_SEGMENT = "memfd:meshvisor-payload"
_ARENA = f"memfd:{arena_wire.ARENA_NAME}"


def _held(pid: int, kind: str) -> list[str]:
    """The paths of the descriptors of process `pid` open on memory files named `kind`."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            if kind in os.readlink(f"/proc/{pid}/fd/{fd}"):
                held.append(f"/proc/{pid}/fd/{fd}")
    return held


def _segments_held(pid: int) -> int:
    """How many per-call memory files of shared payloads process `pid` holds open."""
    return len(_held(pid, _SEGMENT))


def _arena(pid: int) -> tuple[int, int, int]:
    """(bytes in use, slots in use, payloads placed) of the payload arena of agent `pid`."""
    arenas = _held(pid, _ARENA)
    return arena_wire.read_header(arenas[0]) if arenas else (0, 0, 0)


@pytest.mark.timeout(150)
def test_a_shared_payload_reaches_every_rank_and_outlives_no_receiver(
    make_procs: Any, stack: Any, tmp_path: Path, root_events: list[Any]
) -> None:
    """Through the arena (a bytearray): every rank gets the argument intact, a write by one
    stays its own; a receiver SIGKILLed while the payload is shared leaves no slot in use
    and nothing in /dev/shm."""
    stack.enter_context(fan_out_from(2))
    receivers = make_procs({"gpus": 3}).spawn("receivers", spa.Receiver)
    pids = receivers.pid.call().get(timeout=T)  # ready: calls fan out from now on
    agent = mesh.testing.local_agent().process.pid
    shm_before = set(os.listdir("/dev/shm"))

    @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.integers(-512, 512), st.integers(0, 1 << 32))
    def reaches_every_rank(offset: int, seed: int) -> None:
        value = bytearray(random.Random(seed).randbytes(sp.SHARED_PAYLOAD_MIN_BYTES + offset))
        expected = hashlib.sha256(value).hexdigest()
        shared = Payload.dump(((value,), {})).nbytes >= sp.SHARED_PAYLOAD_MIN_BYTES
        placed = _arena(agent)[2]
        answers = receivers.digest.call(value).get(timeout=T)
        assert list(answers.values()) == [(expected, False)] * 3, "ranks see no one's writes"
        assert fanned_out(receivers) == [True] * 3
        assert hashlib.sha256(value).hexdigest() == expected
        assert _arena(agent)[2] == placed + shared, "shared through the arena, once"
        wait_until(lambda: _arena(agent)[:2] == (0, 0), timeout=T, what="the slot freed")

    reaches_every_rank()
    _a_receiver_dies_holding_it(receivers, pids, agent, tmp_path / "release", root_events)
    assert set(os.listdir("/dev/shm")) <= shm_before


@pytest.mark.timeout(150)
def test_a_shared_call_to_an_idle_actor_runs_on_the_short_path(make_procs: Any, stack: Any) -> None:
    """Calls through the arena to idle actors run as lone calls (no mailbox, no general
    dispatch), each with its own arguments; an injected failure still applies to them."""
    stack.enter_context(fan_out_from(2))
    receivers = make_procs({"gpus": 2}).spawn("receivers", spa.Receiver)
    agent = mesh.testing.local_agent().process.pid
    value = bytearray(sp.SHARED_PAYLOAD_MIN_BYTES)
    receivers.digest.call(value).get(timeout=T)  # each proc learns the call's route
    before, placed = receivers.lone_calls.call().get(timeout=T), _arena(agent)[2]
    for i in range(10):
        value[0] = i
        expected = hashlib.sha256(value).hexdigest()
        assert list(receivers.digest.call(value).get(timeout=T).values()) == [(expected, False)] * 2
    assert _arena(agent)[2] == placed + 10, "shared through the arena"
    for ranks in (receivers, receivers.slice(gpus=slice(1, 2))):  # the rank ends the header
        answers = ranks.rank_of.call(value).get(timeout=T)
        assert [answer for _, answer in answers] == [(r, len(value)) for r in range(len(ranks))]
    after = receivers.lone_calls.call().get(timeout=T)
    # (a call may take the general path while a proc's event loop handles a message)
    assert all(after.item(gpus=g) - before.item(gpus=g) >= 5 for g in range(2))
    fail_next_call(receivers.slice(gpus=0), ValueError("injected"), "digest").get(timeout=T)
    with pytest.raises(ActorError, match="injected"):
        receivers.digest.call(value).get(timeout=T)
    assert len(receivers.digest.call(value).get(timeout=T)) == 2  # both serve the next one
    wait_until(lambda: _arena(agent)[:2] == (0, 0), timeout=T, what="the slots freed")


def _a_receiver_dies_holding_it(
    receivers: Any, pids: Any, agent: int, release: Path, root_events: list[Any]
) -> None:
    """Rank 2 is SIGKILLed while the three hold the payload: the others answer, it fails,
    and the slot is freed."""
    value = bytearray(sp.SHARED_PAYLOAD_MIN_BYTES)
    futures = list(receivers.hold.stream(value, str(release)))
    wait_until(lambda: _arena(agent)[1] == 1, timeout=T, what="the agent sharing it")
    os.kill(pids.item(gpus=2), 9)
    release.touch()
    outcomes: list[Any] = []
    for future in futures:
        try:
            outcomes.append(future.get(timeout=T))
        except SupervisionError as exc:
            outcomes.append(type(exc))
    assert sorted(outcomes, key=str) == [sp.SHARED_PAYLOAD_MIN_BYTES] * 2 + [SupervisionError]
    # the kill also reaches the root, which records it (it raises in no unrelated line then)
    wait_until(lambda: root_events, timeout=T, what="the kill reaching the root")
    wait_until(lambda: _arena(agent)[:2] == (0, 0), timeout=T, what="the slot freed")


@pytest.mark.timeout(150)
def test_tensors_and_the_largest_payloads_get_a_memory_file_each(
    make_procs: Any, stack: Any, tmp_path: Path, root_events: list[Any]
) -> None:
    """A tensor, and any payload above the arena's limit, is mapped from a memory file of its
    own (a tensor without a copy; a write stays private); the file is closed once every
    recipient answered or died, and nothing is left in /dev/shm."""
    stack.enter_context(fan_out_from(2))
    receivers = make_procs({"gpus": 3}).spawn("receivers", spa.Receiver)
    pids = receivers.pid.call().get(timeout=T)
    agent = mesh.testing.local_agent().process.pid
    shm_before = set(os.listdir("/dev/shm"))
    generator = torch.Generator().manual_seed(0)
    size = (sp.SHARED_PAYLOAD_MIN_BYTES,)
    tensor = torch.randint(0, 255, size, dtype=torch.uint8, generator=generator)
    large = bytearray(os.urandom(arena_wire.ARENA_MAX_PAYLOAD + 1))
    for value in (tensor, large):
        expected = hashlib.sha256(spa.contents(value)).hexdigest()
        answers = receivers.digest.call(value).get(timeout=T)
        assert list(answers.values()) == [(expected, True)] * 3, "mapped, writes stay private"
        assert hashlib.sha256(spa.contents(value)).hexdigest() == expected
        wait_until(lambda: _segments_held(agent) == 0, timeout=T, what="the file closed")
    release = tmp_path / "release"
    futures = list(receivers.hold.stream(tensor, str(release)))
    wait_until(lambda: _segments_held(agent) == 1, timeout=T, what="the agent sharing it")
    os.kill(pids.item(gpus=0), 9)
    release.touch()
    outcomes = []
    for future in futures:
        with contextlib.suppress(SupervisionError):
            outcomes.append(future.get(timeout=T))
    assert outcomes == [tensor.numel()] * 2
    wait_until(lambda: root_events, timeout=T, what="the kill reaching the root")
    wait_until(lambda: _segments_held(agent) == 0, timeout=T, what="the memory file closed")
    assert set(os.listdir("/dev/shm")) <= shm_before


@pytest.mark.timeout(90)
def test_a_large_argument_fans_out_from_a_few_recipients_by_default(make_procs: Any) -> None:
    """Under `fanout_min_recipients`, a call whose payload the agent would share still goes
    through it (from `fanout_min_shared_recipients`); the next small call goes straight."""
    receivers = make_procs({"gpus": 4}).spawn("receivers", spa.Receiver)
    receivers.pid.call().get(timeout=T)
    assert fanned_out(receivers) == [False] * 4
    value = bytearray(sp.SHARED_PAYLOAD_MIN_BYTES)
    digest = hashlib.sha256(value).hexdigest()
    assert list(receivers.digest.call(value).get(timeout=T).values()) == [(digest, False)] * 4
    assert fanned_out(receivers) == [True] * 4
    receivers.pid.call().get(timeout=T)
    assert fanned_out(receivers) == [False] * 4


_PARTS = st.tuples(st.binary(max_size=64), st.lists(st.binary(max_size=4096), max_size=4))


@given(_PARTS)
def test_a_memory_file_maps_back_into_the_payload_written_and_nothing_else(
    parts: tuple[bytes, list[bytes]],
) -> None:
    body, buffers = parts
    call = wire.CallActor(1, "ipc:///tmp/x/caller", "actor", "echo", ("gpus",), (2,), 0)
    fd, shared = sp.share_payload(call, Payload(body, buffers))
    try:
        mapped = sp.mapped_payload(shared)
        assert (bytes(mapped.body), [bytes(b) for b in mapped.buffers]) == (body, buffers)
        for buffer in mapped.buffers:  # private copies: writable, and writes stay here
            buffer[:1] = b"x" * min(1, len(buffer))
        again = sp.mapped_payload(shared)
        assert [bytes(b) for b in again.buffers] == buffers
        with pytest.raises(ValueError, match="wrong token"):
            sp.mapped_payload(dataclasses.replace(shared, call_id=shared.call_id + 1))
        with pytest.raises(ValueError, match="malformed"):
            sp.mapped_payload(dataclasses.replace(shared, body_bytes=-1))
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match=r"is gone|not the shared payload"):
        sp.mapped_payload(shared)  # closed: gone, or its number taken by another file


def test_a_proc_refuses_headers_and_files_that_are_not_the_payload_they_name() -> None:
    call = wire.CallActor(3, "ipc:///tmp/x/caller", "actor", "echo", ("gpus",), (2,), 1)
    fd, shared = sp.share_payload(call, Payload(b"body", [b"x" * 3000]))
    unsealed = os.memfd_create("meshvisor-payload")
    loose = os.memfd_create("meshvisor-payload", os.MFD_ALLOW_SEALING)
    try:
        bad = {
            "wrong token": dataclasses.replace(shared, call_id=shared.call_id + 1),
            "malformed": dataclasses.replace(shared, body_bytes=-1),
            "must be ints": dataclasses.replace(shared, fd=str(shared.fd)),
            "not a shared payload": dataclasses.replace(shared, file_id=shared.file_id + 1),
            "of 3013 bytes": dataclasses.replace(shared, body_bytes=5),
        }
        os.fchmod(unsealed, 0o600)
        os.ftruncate(loose, 3012)
        fcntl.fcntl(loose, fcntl.F_ADD_SEALS, sp.SEALS)
        os.fchmod(loose, 0o644)
        for other, reason in ((unsealed, "not sealed"), (loose, "not a shared payload")):
            bad[reason] = dataclasses.replace(shared, fd=other, file_id=os.fstat(other).st_ino)
        for reason, header in bad.items():
            with pytest.raises(ValueError, match=reason):
                sp.mapped_payload(header)
    finally:
        for opened in (fd, unsealed, loose):
            os.close(opened)


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    """Context managers a test enters, left after it, pass or fail."""
    with contextlib.ExitStack() as entered:
        yield entered
