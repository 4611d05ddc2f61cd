"""The payload arena (`mesh/_engine/payload_arena.py`), both halves in this process: a slot
reads back as the payload written, no value loaded from a slot changes when the slot is
reused, slots never overlap and all come back, and a proc refuses any header or file that is
not what it should be."""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import os
import pickle
from typing import Any

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.testing import PayloadArena, wire
from mesh.testing import arena_wire as aw
from transport import Payload

_CALL = wire.CallActor(1, None, "actor", "echo", ("gpus",), (2,), 0)
_PARTS = st.tuples(st.binary(max_size=64), st.lists(st.binary(max_size=9000), max_size=4))


def _header(arena: PayloadArena, call: Any) -> tuple[int, int, int]:
    return aw.read_header(f"/proc/self/fd/{call.fd}")


@given(st.lists(_PARTS, min_size=1, max_size=6))
def test_slots_read_back_as_written_never_overlap_and_all_come_back(
    payloads: list[tuple[bytes, list[bytes]]],
) -> None:
    arena, maps = PayloadArena(capacity=64 << 10), aw.ArenaMaps()
    placed = [
        (arena.put(_CALL, Payload(body, buffers)), body, buffers) for body, buffers in payloads
    ]
    calls = [(call, body, buffers) for call, body, buffers in placed if call is not None]
    assert calls, "the first payload always fits"
    ends = sorted((c.offset, c.offset + aw.slot_bytes(Payload(b, bs))) for c, b, bs in calls)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(ends))
    for call, body, buffers in calls:
        read = maps.payload(call)
        assert (bytes(read.body), [bytes(b) for b in read.buffers]) == (body, buffers)
    assert _header(arena, calls[0][0])[1:] == (len(calls), len(calls))
    for call, _, _ in calls[::2][::-1] + calls[1::2]:  # out of order
        arena.free(call.offset)
    assert _header(arena, calls[0][0])[:2] == (0, 0)
    whole = Payload(b"", [bytes((64 << 10) - aw.ARENA_HEADER_BYTES - aw.TOKEN_BYTES)])
    assert arena.put(_CALL, whole) is not None, "freed slots merge back into one"


def _values() -> tuple[Any, ...]:
    return (
        b"b" * 5000,
        bytearray(b"a" * 5000),
        torch.arange(2000, dtype=torch.int32),
        numpy.arange(2000, dtype=numpy.int16),
        pickle.PickleBuffer(bytearray(b"p" * 5000)),
        "small",
    )


@pytest.mark.parametrize("first", range(6))
def test_values_loaded_from_a_slot_are_private_and_outlive_its_reuse(first: int) -> None:
    """Whatever comes first in the arguments (a global that is not a copying rebuilder
    makes every later buffer a copy), nothing loaded keeps a view of the slot."""
    values = _values()
    args = values[first:] + values[:first]
    arena, maps = PayloadArena(capacity=1 << 20), aw.ArenaMaps()
    for _ in range(2):  # the second time, a body known to copy everything is loaded as it is
        call = arena.put(_CALL, Payload.dump((args, {})))
        assert call is not None
        loaded, _ = maps.payload(call).load()
        arena.free(call.offset)
        again = arena.put(_CALL, Payload(b"\xff" * 64, [b"\xff" * 40000]))  # the same slot
        assert again is not None and again.offset == call.offset
        arena.free(again.offset)
        assert [_plain(value) for value in loaded] == [_plain(value) for value in args]
        for value in loaded:
            if isinstance(value, (torch.Tensor, numpy.ndarray)):
                value += 1  # writable, and private


@pytest.mark.parametrize("value", [b"b" * 5000, bytearray(b"a" * 5000)])
def test_a_body_loaded_again_still_copies_out_of_the_slot(value: Any) -> None:
    """Loaded a second time, a payload whose body copied everything the first time (it is
    then unpickled without the checking unpickler) still gives values of its own."""
    arena, maps = PayloadArena(capacity=1 << 20), aw.ArenaMaps()
    loaded = []
    for _ in range(3):
        call = arena.put(_CALL, Payload.dump(((value,), {})))
        assert call is not None
        loaded.append(maps.payload(call).load()[0][0])
        arena.free(call.offset)
        overwrite = arena.put(_CALL, Payload(b"\xff" * 64, [b"\xff" * 40000]))
        assert overwrite is not None and overwrite.offset == call.offset
        arena.free(overwrite.offset)
    assert all(type(v) is type(value) and v == value for v in loaded)


def _plain(value: Any) -> Any:
    """`value`'s contents, comparable across the types a buffer may come back as."""
    if isinstance(value, (torch.Tensor, numpy.ndarray)):
        return (type(value).__name__, value.tolist())
    if isinstance(value, pickle.PickleBuffer):
        return bytes(value.raw())
    return value if isinstance(value, str) else bytes(value)


def test_a_proc_refuses_headers_and_files_that_are_not_its_arenas() -> None:
    arena, maps = PayloadArena(capacity=1 << 20), aw.ArenaMaps()
    call = arena.put(_CALL, Payload(b"body", [b"x" * 3000]))
    assert call is not None
    bad = {
        "wrong token": dataclasses.replace(call, call_id=call.call_id + 1),
        "outside its slots": dataclasses.replace(call, offset=(1 << 20) - 100),
        "malformed": dataclasses.replace(call, body_bytes=-1),
        "must be ints": dataclasses.replace(call, offset="4096"),
    }
    for reason, header in bad.items():
        with pytest.raises(ValueError, match=reason):
            maps.payload(header)
    unsealed = os.memfd_create(aw.ARENA_NAME)
    loose = os.memfd_create(aw.ARENA_NAME, os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(unsealed, 0o600)
        os.ftruncate(loose, 1 << 20)
        fcntl.fcntl(loose, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        os.fchmod(loose, 0o644)
        for fd, reason in ((unsealed, "not sealed"), (loose, "not a payload arena")):
            header = dataclasses.replace(call, fd=fd, arena_id=os.fstat(fd).st_ino)
            with pytest.raises(ValueError, match=reason):
                aw.ArenaMaps().payload(header)
    finally:
        os.close(unsealed)
        os.close(loose)
    with pytest.raises(ValueError, match="not a payload arena"):
        maps.payload(dataclasses.replace(call, arena_id=call.arena_id + 1))


@settings(max_examples=20)
@given(st.lists(st.integers(1, 300_000), min_size=1, max_size=12))
def test_a_full_arena_says_so_and_takes_payloads_again_once_freed(sizes: list[int]) -> None:
    arena = PayloadArena(capacity=1 << 20)
    taken = [arena.put(_CALL, Payload(b"", [bytes(size)])) for size in sizes]
    assert taken[0] is not None
    for call in taken:
        if call is not None:
            arena.free(call.offset)
    assert arena.put(_CALL, Payload(b"", [bytes(sizes[0])])) is not None
