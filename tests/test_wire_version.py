"""The wire version (the byte after b"MV"): a message of another version is refused with an
error naming both versions, never decoded as if it were of this one.

Version 3 had no binary headers: its peers refused codec bytes `C` and `R` as an "unknown
header encoding". Version 4 brought them, so a version-3 peer must not be read as one.
Version 5 added fields to two agent messages (`StopProcs.why`, `ProcExited.why_stopped`).
Version 6 moved the rank of `ArenaCall` and `SharedCall` to the end of their headers (the
agent packs it after a header encoded once per call): a version-5 proc would read another
field as the rank.
"""

from __future__ import annotations

import struct
from typing import Any

import actors
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_agent_hardening import T, ping, raw_peer

from mesh.testing import arena_wire, wire
from transport import MAGIC, WIRE_VERSION, MalformedMessage, WireVersionMismatch, decode, encode


def of_version(frame: bytes, version: int) -> bytes:
    """`frame` as a peer speaking wire version `version` would frame it."""
    return b"MV" + bytes([version]) + frame[len(MAGIC) :]


def test_the_version_is_the_byte_after_the_magic_letters() -> None:
    assert b"MV" + bytes([WIRE_VERSION]) == MAGIC
    assert WIRE_VERSION == 6


def test_a_message_of_the_old_version_names_both_versions() -> None:
    frame = bytes(encode(wire.Reply(1, 2))[0])
    with pytest.raises(WireVersionMismatch, match=r"wire version 5.*speaks version 6"):
        decode([of_version(frame, 5)])


def test_an_arena_call_of_version_5_is_refused_not_read_with_another_field_as_its_rank() -> None:
    call = arena_wire.ArenaCall(9, None, "a", "e", ("gpus",), (4,), 77, 5, 6, 4096, 10, (), 3)
    frame = bytes(encode(call)[0])
    assert decode([frame]).header.rank == 3
    with pytest.raises(WireVersionMismatch, match=r"wire version 5.*speaks version 6"):
        decode([of_version(frame, 5)])


@given(st.integers(min_value=0, max_value=255).filter(lambda v: v != WIRE_VERSION))
def test_every_other_version_is_a_mismatch(version: int) -> None:
    frame = bytes(encode(wire.Reply(7, 0))[0])
    with pytest.raises(WireVersionMismatch, match=f"wire version {version},"):
        decode([of_version(frame, version)])


def test_a_batch_of_another_version_is_a_mismatch() -> None:
    frame = bytes(encode(wire.Reply(7, 0))[0])
    batch = b"MB\x09" + struct.pack("<I", 1) + struct.pack("<I", len(frame)) + frame
    with pytest.raises(WireVersionMismatch, match=r"a batch of wire version 9, .* version 1"):
        decode([batch])


def test_a_frame_without_the_magic_letters_is_no_version_mismatch() -> None:
    with pytest.raises(MalformedMessage, match="without the meshvisor header") as raised:
        decode([b"XY\x04" + b"\x00" * 8])
    assert not isinstance(raised.value, WireVersionMismatch)


@pytest.mark.timeout(60)
def test_a_proc_sent_a_message_of_the_old_version_keeps_serving(make_procs: Any) -> None:
    exposed = make_procs({"gpus": 1}).spawn("who", actors.Exposed)
    pid, address, mesh_id = exposed.reach.call_one().get(timeout=T)
    with raw_peer(address) as peer:
        call = bytes(encode(ping(mesh_id, peer.inbox.address))[0])
        peer.send([of_version(call, 3)])
        answer = peer.answer(ping(mesh_id, peer.inbox.address))
        assert type(answer.header) is wire.Reply and answer.header.rank == 0
    assert exposed.reach.call_one().get(timeout=T)[0] == pid
