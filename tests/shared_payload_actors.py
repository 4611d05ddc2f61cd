"""Actors for the shared-payload tests: they report how a large argument reached them."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

from mesh import Actor, current_rank, endpoint, testing

_SEGMENT = "memfd:meshvisor-payload"


def _mapped() -> bool:
    """Whether this proc maps a host agent's shared payload now."""
    return _SEGMENT in Path("/proc/self/maps").read_text()


def contents(value: Any) -> bytes:
    """The bytes of a tensor or a bytearray."""
    return bytes(value) if isinstance(value, bytearray) else value.numpy().tobytes()


class Receiver(Actor):
    """Digests its tensor argument, then overwrites it: a write must stay private to it."""

    @endpoint
    def digest(self, value: Any) -> tuple[str, bool]:
        """(sha256 of the tensor's or bytearray's bytes, whether it lies in a shared payload
        file now)."""
        found = hashlib.sha256(contents(value)).hexdigest()
        mapped = _mapped()
        if isinstance(value, bytearray):
            value[:] = b"\xff" * len(value)  # its own copy: no other rank may see this
        else:
            value.fill_(0xFF)  # copy-on-write: the other ranks must not see this
        return found, mapped

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def rank_of(self, value: Any) -> tuple[int, int]:
        """(this actor's rank in the call, the argument's length)."""
        return current_rank().rank, len(value)

    @endpoint
    def lone_calls(self) -> int:
        """How many calls this proc's receiver ran on the short path (`lone_calls.py`)."""
        return testing.receiver_lone_calls()

    @endpoint
    def hold(self, tensor: Any, until: str) -> int:
        """Keep the shared payload mapped until the file `until` exists (30 s at most)."""
        deadline = time.monotonic() + 30
        while not os.path.exists(until) and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(tensor) if isinstance(tensor, bytearray) else int(tensor.numel())
