"""`Tap`: what a process writes to sys.stdout or sys.stderr, from any thread, read while it is
being written without losing any of it.

A test that waits for a line that another thread prints (the client's loop thread: supervision
warnings, proc output) must not poll ``capsys``/``capfd.readouterr()``: each call reads the
capture and then truncates it, so what a thread writes between the two is lost for good.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
from collections.abc import Iterator
from typing import Literal, TextIO


class Tap(io.TextIOBase):
    """Stands in for `stream`: keeps every write and passes it on."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream
        self._parts: list[str] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._parts.append(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def writable(self) -> bool:
        return True

    def text(self) -> str:
        """Everything written so far (nothing is consumed)."""
        with self._lock:
            return "".join(self._parts)

    def lines(self) -> list[str]:
        return self.text().splitlines()


@contextlib.contextmanager
def tapped(name: Literal["stdout", "stderr"]) -> Iterator[Tap]:
    """``sys.stdout`` or ``sys.stderr`` tapped for the ``with`` block. Use it in a test's body:
    pytest's capture sets both streams anew at each phase of a test (a fixture's would go)."""
    original = getattr(sys, name)
    tap = Tap(original)
    setattr(sys, name, tap)
    try:
        yield tap
    finally:
        setattr(sys, name, original)
