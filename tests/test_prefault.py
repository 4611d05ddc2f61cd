"""The heal's prefault thread makes memory present without changing a byte of it.

`recovery.testing.Prefault` (`recovery/_prefault.py`) runs beside the copy of a heal's chunks
into the same tensors, so it must never write them: whatever the copy wrote, before, during or
after it populates a page, stays. Tensors of any size and alignment (views that start inside a
page), written in any order of pieces.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recovery.testing import PREFAULT_STRIDE_BYTES as STRIDE_BYTES
from recovery.testing import Prefault

pytestmark = pytest.mark.timeout(120)


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3 * STRIDE_BYTES // 2), min_size=1, max_size=3),
    offset=st.integers(0, 4095),
    pieces=st.integers(1, 9),
    seed=st.integers(0, 2**31),
)
def test_bytes_written_beside_a_prefault_stay_as_written(
    sizes: list[int], offset: int, pieces: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    backing = [torch.empty(size + offset, dtype=torch.uint8) for size in sizes]
    targets = [memory[offset:] for memory in backing]  # starts anywhere in a page
    wanted = [
        torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator) for size in sizes
    ]
    prefault = Prefault(targets)
    for target, source in zip(targets, wanted):
        for part in torch.arange(target.numel()).tensor_split(pieces):
            if part.numel():
                target[part[0] : part[-1] + 1].copy_(source[part[0] : part[-1] + 1])
    prefault.close()
    assert all(torch.equal(target, source) for target, source in zip(targets, wanted))


def test_a_prefault_of_nothing_or_of_other_devices_starts_no_thread_and_closes() -> None:
    Prefault([]).close()
    Prefault([torch.empty(0, device="meta")]).close()
