"""`ShutdownRequest`: a shutdown asked from a signal handler (SIGTERM), which wakes the agent's
wait at once: a flag alone is read only when something else wakes it (an idle agent's wait can
last its owner timeout, or for ever)."""

from __future__ import annotations

import contextlib
import os


class ShutdownRequest:
    """A flag and a pipe: `ask` (signal-safe) sets the flag and makes `fileno` readable."""

    def __init__(self) -> None:
        self.asked = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        return self._read

    def ask(self) -> None:
        self.asked = True
        with contextlib.suppress(OSError):  # full: a wake-up is already waiting
            os.write(self._write, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(OSError):
            os.read(self._read, 4096)

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
