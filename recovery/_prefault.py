"""The memory a heal writes into, made present ahead of the copy by a thread of its own.

A replacement heals into tensors it has never written (its optimizer's state is new, and it
built its model without initialising it): each 4 KiB page costs a page fault (the kernel
zeroes it), taken by the thread that copies each received chunk into place, between a reply
and its next request. `Prefault` asks the kernel to populate those pages ahead of the copy, in
the order the heal fetches them (`MADV_POPULATE_WRITE`, Linux 5.14 and later): that faults them
in without writing them, so it cannot race with the copy, whose bytes stay as written.
Elsewhere (another OS, an older kernel) it does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MADV_POPULATE_WRITE = 23
#: Bytes populated per call: the thread looks whether to stop between two calls.
STRIDE_BYTES = 16 << 20


def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_MADVISE = _madvise()


class Prefault:
    """Populates the pages of `tensors` (CPU memory), in order, on a thread, until done or
    `close`d."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._tensors = [t for t in tensors if t.device.type == "cpu"]  # alive while it runs
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if _MADVISE is not None and self._tensors:
            self._thread = threading.Thread(target=self._run, name="heal-prefault", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop populating (the heal is over, or failed) and wait for the call under way."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        for tensor in self._tensors:
            if not self._populate(tensor.data_ptr(), tensor.nbytes):
                return

    def _populate(self, start: int, size: int) -> bool:
        """Populate bytes start..start+size, page aligned; False to stop (asked, or the
        kernel refuses: then it would refuse every range)."""
        page = mmap.PAGESIZE
        first, end = start - start % page, start + size
        for at in range(first, end, STRIDE_BYTES):
            if self._stop.is_set():
                return False
            length = min(STRIDE_BYTES, end - at)
            length += -length % page
            if _MADVISE(at, length, MADV_POPULATE_WRITE) != 0:
                return False
        return True
