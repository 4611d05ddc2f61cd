"""Lent buffers (`transport.Lent`): sent from their owner's memory without a copy, kept alive
until zmq is done with them, released once written out or dropped with their connection; and
a heal donor's use of them. Real zmq sockets over ipc, in this process."""

from __future__ import annotations

import ctypes
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import transport
from recovery import Replica
from transport import (
    LEND_MIN_BYTES,
    Inbox,
    Lent,
    Outbox,
    Payload,
    encode,
    message_type,
    private_runtime_dir,
)

pytestmark = pytest.mark.timeout(120)


@message_type
@dataclass(frozen=True, slots=True)
class Lending:
    """A header type registered for these tests."""

    seq: int


@dataclass
class Link:
    """An outbox and an inbox bound at an ipc address, in one context."""

    context: zmq.Context[Any]
    inbox: Inbox
    outbox: Outbox
    folder: str

    def receive(self, timeout_s: float = 30.0) -> Any:
        """The payload of the next message, loaded."""
        deadline = time.monotonic() + timeout_s
        while (envelope := self.inbox.receive_nowait()) is None:
            assert time.monotonic() < deadline, "no message arrived"
            self.inbox.poll(100)
        assert envelope.payload is not None
        return envelope.payload.load()


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    context = transport.new_context()
    folder = private_runtime_dir("mvt-lend-")
    inbox = Inbox(context, f"ipc://{folder}/inbox")
    outbox = Outbox(context)
    try:
        yield Link(context, inbox, outbox, folder)
    finally:
        outbox.close(0)
        inbox.close()
        transport.close_context(context)
        shutil.rmtree(folder, ignore_errors=True)


def _address_of(buffer: Any) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(memoryview(buffer).cast("B")))


_DTYPES = st.sampled_from(["uint8", "int16", "int32", "float32", "float64", "complex64", "bool"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.data_too_large])
@given(
    arrays=st.lists(
        hnp.arrays(_DTYPES, st.integers(0, 40_000), elements={"allow_nan": False}),
        min_size=1,
        max_size=3,
    )
)
def test_lent_arrays_arrive_whole_writable_and_are_released(
    link: Link, arrays: list[np.ndarray]
) -> None:
    """Any sizes and dtypes: each lent buffer is its own frame, over the owner's own memory
    unless it is small (then a copy), the receiver gets the same bytes (writable), and every
    lent buffer is released after."""
    lent = [Lent(array) for array in arrays]
    payload = Payload.dump(("head", lent, b"x" * 5000))
    frames = [b for b in payload.buffers if isinstance(b, zmq.Frame)]
    assert len(frames) == len(arrays)
    lent_at = [_address_of(frame) for frame in frames if len(frame.buffer) >= LEND_MIN_BYTES]
    assert lent_at == [a.ctypes.data for a in arrays if a.nbytes >= LEND_MIN_BYTES], "copied"
    link.outbox.send(link.inbox.address, encode(Lending(1), payload))
    del payload, frames  # zmq holds the lent frames until they are written out
    head, views, tail = link.receive()
    assert head == "head" and tail == b"x" * 5000
    for view, array in zip(views, arrays):
        assert isinstance(view, memoryview) and not view.readonly
        assert view.tobytes() == array.tobytes()
    assert all(item.wait_released(30) for item in lent)


def test_the_transport_keeps_a_lent_buffer_alive_and_the_owner_may_change_it_once_released(
    link: Link,
) -> None:
    """The owner drops its last reference right after send(): the bytes still arrive. Once
    released, changing the buffer no longer changes what was sent."""
    tensor = torch.arange(4 << 20, dtype=torch.float32)  # 16 MiB
    expected = tensor.clone()
    raw = tensor.view(torch.uint8).numpy()
    lent = Lent(raw)
    link.outbox.send(link.inbox.address, encode(Lending(2), Payload.dump(lent)))
    del tensor, raw
    got = link.receive()
    assert lent.wait_released(30)
    lent.view[:] = b"\0" * lent.view.nbytes  # the owner's memory, changed after the release
    assert torch.equal(torch.frombuffer(got, dtype=torch.float32), expected)


def test_an_unsent_lent_buffer_is_released_when_its_connection_is_dropped(link: Link) -> None:
    """Queued for a peer that never binds: not released until the outbox forgets the peer,
    which drops what was queued for it. A message never sent releases it too."""
    nobody = f"ipc://{link.folder}/nobody"
    lent = Lent(bytearray(1 << 20))
    link.outbox.send(nobody, encode(Lending(3), Payload.dump(lent)))
    assert not lent.wait_released(0.2)
    assert not lent.released
    link.outbox.forget(nobody)
    assert lent.wait_released(30)
    never_sent = Lent(bytearray(1 << 20))
    payload = Payload.dump(never_sent)
    assert not never_sent.released
    del payload
    assert never_sent.wait_released(30)


def test_a_lent_buffer_is_released_only_once_its_receiver_took_it(link: Link) -> None:
    """The owner waits for the release before changing its memory: a receiver that binds
    late still gets the bytes as they were when sent."""
    late = f"ipc://{link.folder}/late"
    owner = bytearray(b"a" * (1 << 20))
    lent = Lent(owner)
    link.outbox.send(late, encode(Lending(4), Payload.dump(lent)))
    received: list[Any] = []
    bound = threading.Event()

    def bind_late() -> None:
        inbox = Inbox(link.context, late)
        try:
            bound.set()
            deadline = time.monotonic() + 30
            while (envelope := inbox.receive_nowait()) is None and time.monotonic() < deadline:
                inbox.poll(100)
            received.append(envelope.payload.load() if envelope and envelope.payload else None)
        finally:
            inbox.close()

    assert not lent.wait_released(0.1)
    thread = threading.Thread(target=bind_late)
    thread.start()
    try:
        assert bound.wait(30) and lent.wait_released(30)
        owner[:] = b"b" * len(owner)
    finally:
        thread.join(60)
        link.outbox.forget(late)
    assert received and received[0] is not None and bytes(received[0]) == b"a" * (1 << 20)


def test_only_contiguous_buffers_can_be_lent() -> None:
    for strided in (np.arange(100)[::2], np.zeros((4, 4), order="F")):
        with pytest.raises(ValueError, match="only a C-contiguous buffer"):
            Lent(strided)


class WideReplica(Replica):
    """A replica whose first tensor (a 256x256 weight, 256 KiB) is large enough to be lent."""

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_heal_donor_never_changes_bytes_the_transport_has_not_sent(link: Link) -> None:
    """A donor serves a chunk (`heal_chunks`) to a receiver that does not read (nobody bound
    yet), then its state is about to change (here a heal of its own, which it refuses for want
    of peers): that returns at once and the weight moves to a copy, so the changes that follow
    do not reach the chunk in flight. A chunk already sent costs no copy."""
    replica = WideReplica()
    replica.committed_step = 3
    weight = cast(torch.nn.Linear, replica.model).weight
    before = weight.detach().clone()
    memory = weight.data_ptr()

    served: list[Any] = []

    def serve() -> Payload:
        served[:] = Replica.heal_chunks.function(replica, 3, [(0, 0, before.nbytes)])
        return Payload.dump(served)

    def step_begins() -> None:
        with pytest.raises(ValueError, match="at least one live peer"):
            Replica.heal_from.function(replica, [])

    link.outbox.send(link.inbox.address, encode(Lending(5), serve()))
    assert bytes(link.receive()[0].view) == before.numpy().tobytes()
    assert served[0].lent.wait_released(30)
    step_begins()
    assert weight.data_ptr() == memory, "a sent chunk's tensor was copied"
    late = f"ipc://{link.folder}/late-receiver"
    link.outbox.send(late, encode(Lending(6), serve()))
    started = time.monotonic()
    step_begins()
    assert time.monotonic() - started < 5, "the donor waited for a receiver that does not read"
    assert weight.data_ptr() != memory and torch.equal(weight.detach(), before)
    with torch.no_grad():
        weight.fill_(7.0)  # the state changes
    inbox = Inbox(link.context, late)
    try:
        deadline = time.monotonic() + 30
        while (envelope := inbox.receive_nowait()) is None:
            assert time.monotonic() < deadline, "the lent chunk never arrived"
            inbox.poll(100)
        assert envelope.payload is not None
        assert bytes(envelope.payload.load()[0].view) == before.numpy().tobytes()
    finally:
        inbox.close()
        link.outbox.forget(late)
