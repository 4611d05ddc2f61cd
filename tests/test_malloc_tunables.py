"""glibc's malloc tunables in forked procs: ``GLIBC_TUNABLES`` in a spawn's ``env`` applies to
its procs although they are forked from a fork server that started without it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import actors
import pytest

from mesh.testing import apply_malloc_tunables

pytestmark = pytest.mark.timeout(60)

KEEP_THE_HEAP = (
    "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=2147483648:"
    "glibc.malloc.arena_max=1"
)
PAGES_OF_64_MIB = 16384


def test_a_forked_proc_applies_the_malloc_tunables_of_its_spawn(
    make_procs: Callable[..., Any],
) -> None:
    """64 MiB buffers, allocated and freed on an endpoint's worker thread, are mapped afresh
    by default (a page fault per page each time); with the tunables the heap keeps them."""
    plain = make_procs({"gpus": 1}).spawn("plain", actors.Allocator)
    tuned = make_procs({"gpus": 1}, env={"GLIBC_TUNABLES": KEEP_THE_HEAP})
    kept = tuned.spawn("kept", actors.Allocator)
    plain_faults = plain.faults_of_allocations.call_one(64, 4).get(timeout=30)
    kept_faults = kept.faults_of_allocations.call_one(64, 4).get(timeout=30)
    assert plain_faults > 4 * PAGES_OF_64_MIB // 2, plain_faults
    assert kept_faults < 4 * PAGES_OF_64_MIB // 20, kept_faults


def test_a_proc_with_tunables_it_cannot_apply_still_starts(
    make_procs: Callable[..., Any],
) -> None:
    """Entries mallopt has no parameter for, or bad values, are skipped (the proc logs them);
    the others still apply."""
    env = {"GLIBC_TUNABLES": f"glibc.malloc.tcache_count=0:glibc.malloc.top_pad=x:{KEEP_THE_HEAP}"}
    kept = make_procs({"gpus": 1}, env=env).spawn("kept", actors.Allocator)
    assert kept.faults_of_allocations.call_one(64, 4).get(timeout=30) < 4 * PAGES_OF_64_MIB // 20


THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()


@pytest.mark.skipif("[never]" in THP_MODE, reason="this kernel's transparent huge pages are off")
def test_torchs_huge_page_switch_in_a_spawns_env_reaches_its_forked_procs(
    make_procs: Callable[..., Any],
) -> None:
    """torch reads ``THP_MEM_ALLOC_ENABLE`` at a process's first tensor, not when it is
    imported: a fork server that preloaded torch leaves the choice to each proc's env."""
    on = {"MESHVISOR_PRELOAD": "torch", "THP_MEM_ALLOC_ENABLE": "1"}
    off = {"MESHVISOR_PRELOAD": "torch", "THP_MEM_ALLOC_ENABLE": "0"}
    huge = make_procs({"gpus": 1}, env=on).spawn("huge", actors.Allocator)
    plain = make_procs({"gpus": 1}, env=off).spawn("plain", actors.Allocator)
    assert huge.huge_pages_of_a_tensor.call_one(64).get(timeout=30) >= 2048
    if "[madvise]" in THP_MODE:  # in "always" mode the kernel uses them for any memory
        assert plain.huge_pages_of_a_tensor.call_one(64).get(timeout=30) == 0


def test_the_entries_that_cannot_apply_are_named_with_why() -> None:
    """Only glibc.malloc.* entries count; those are checked before anything is set (no
    mallopt call happens for these, so this process's malloc is left as it is)."""
    problems = apply_malloc_tunables(
        "glibc.cpu.hwcaps=-AVX:glibc.malloc.tcache_count=0:glibc.malloc.top_pad=x"
    )
    assert len(problems) == 2, problems
    assert problems[0].startswith("glibc.malloc.tcache_count: only glibc.malloc.trim_threshold")
    assert problems[1] == "glibc.malloc.top_pad=x: the value must be a whole number"
    assert apply_malloc_tunables("glibc.cpu.hwcaps=-AVX") == []
