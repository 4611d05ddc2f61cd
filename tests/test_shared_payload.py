"""A large argument fanned out to several procs of one host travels once, in one memory file
the procs map (`mesh/_engine/shared_payload.py`): every rank gets it intact, a write by one
rank stays its own, and the file is freed once every recipient answered or died."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
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
from mesh.testing import fan_out_from, fanned_out, wire
from mesh.testing import shared_payload_wire as sp
from supervision import SupervisionError
from transport import Payload

T = 30  # seconds: the bound on every wait in this module (never reached when things work)
_SEGMENT = "memfd:meshvisor-payload"


def _segments_held(pid: int) -> int:
    """How many shared payloads process `pid` holds open."""
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            held += _SEGMENT in os.readlink(f"/proc/{pid}/fd/{fd}")
    return held


@pytest.mark.timeout(150)
def test_a_shared_payload_reaches_every_rank_and_outlives_no_receiver(
    make_procs: Any, stack: Any, tmp_path: Path, root_events: list[Any]
) -> None:
    """Every rank gets the argument intact, a write by one stays its own; a receiver
    SIGKILLed while the payload is shared leaves no memory file open and nothing in /dev/shm."""
    stack.enter_context(fan_out_from(2))
    receivers = make_procs({"gpus": 3}).spawn("receivers", spa.Receiver)
    pids = receivers.pid.call().get(timeout=T)  # ready: calls fan out from now on
    agent = mesh.testing.local_agent().process.pid
    shm_before = set(os.listdir("/dev/shm"))
    generator = torch.Generator().manual_seed(0)

    @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.integers(-512, 512))
    def reaches_every_rank(offset: int) -> None:
        size = sp.SHARED_PAYLOAD_MIN_BYTES + offset
        tensor = torch.randint(0, 255, (size,), dtype=torch.uint8, generator=generator)
        expected = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
        shared = Payload.dump(((tensor,), {})).nbytes >= sp.SHARED_PAYLOAD_MIN_BYTES
        answers = receivers.digest.call(tensor).get(timeout=T)
        assert list(answers.values()) == [(expected, shared)] * 3, "ranks see no one's writes"
        assert fanned_out(receivers) == [True] * 3
        assert hashlib.sha256(tensor.numpy().tobytes()).hexdigest() == expected
        wait_until(lambda: _segments_held(agent) == 0, timeout=T, what="the segment closed")

    reaches_every_rank()

    release = tmp_path / "release"
    tensor = torch.ones(sp.SHARED_PAYLOAD_MIN_BYTES, dtype=torch.uint8)
    futures = list(receivers.hold.stream(tensor, str(release)))
    wait_until(lambda: _segments_held(agent) == 1, timeout=T, what="the agent sharing it")
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
    wait_until(lambda: _segments_held(agent) == 0, timeout=T, what="the segment closed")
    assert set(os.listdir("/dev/shm")) <= shm_before


_PARTS = st.tuples(st.binary(max_size=64), st.lists(st.binary(max_size=4096), max_size=4))


@given(_PARTS)
def test_a_memory_file_maps_back_into_the_payload_written_and_nothing_else(
    parts: tuple[bytes, list[bytes]],
) -> None:
    body, buffers = parts
    call = wire.CallActor(1, None, "actor", "echo", ("gpus",), (2,), 0)
    fd, shared = sp.share_payload(call, Payload(body, buffers))
    try:
        mapped = sp.mapped_payload(shared)
        assert (bytes(mapped.body), [bytes(b) for b in mapped.buffers]) == (body, buffers)
        for buffer in mapped.buffers:  # private copies: writable, and writes stay here
            buffer[:1] = b"x" * min(1, len(buffer))
        again = sp.mapped_payload(shared)
        assert [bytes(b) for b in again.buffers] == buffers
        with pytest.raises(ValueError, match="wrong token"):
            sp.mapped_payload(dataclasses.replace(shared, token=bytes(16)))
        with pytest.raises(ValueError, match="malformed"):
            sp.mapped_payload(dataclasses.replace(shared, body_bytes=-1))
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match=r"is gone|not the shared payload"):
        sp.mapped_payload(shared)  # closed: gone, or its number taken by another file


@pytest.fixture
def stack() -> Iterator[contextlib.ExitStack]:
    """Context managers a test enters, left after it, pass or fail."""
    with contextlib.ExitStack() as entered:
        yield entered
