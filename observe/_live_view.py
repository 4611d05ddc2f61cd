"""The live view: a full-screen snapshot refreshed every interval until the user presses q.

Keys are read from the terminal in cbreak mode (one key at a time, no echo), restored on the
way out whatever happens; without a terminal on stdin the view runs until interrupted.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Iterator

from rich.console import Console
from rich.live import Live

from observe._render import render
from observe._snapshot import SnapshotReader

#: Keys that end the view.
QUIT_KEYS = ("q", "Q")
HELP_LINE = "q quits"


def run_live_view(reader: SnapshotReader, interval_s: float, timeout_s: float, events: int) -> None:
    """Show snapshots from `reader` every `interval_s` until a quit key or Ctrl-C."""
    console = Console()
    with _keys() as read_key, Live(console=console, screen=True, auto_refresh=False) as live:
        while True:
            started = time.monotonic()
            snapshot = reader.take(timeout_s)
            live.update(render(snapshot, events, HELP_LINE), refresh=True)
            if _quit_within(read_key, interval_s - (time.monotonic() - started)):
                return


def _quit_within(read_key: _KeyReader, seconds: float) -> bool:
    """Wait up to `seconds` for a quit key; whether one came."""
    deadline = time.monotonic() + max(0.0, seconds)
    while True:
        key = read_key(max(0.0, deadline - time.monotonic()))
        if key in QUIT_KEYS:
            return True
        if time.monotonic() >= deadline:
            return False


class _KeyReader:
    """Reads single keys from a terminal file descriptor, or waits when there is none."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def __call__(self, timeout_s: float) -> str | None:
        """The next key within `timeout_s`, or None."""
        if self._fd is None:
            time.sleep(timeout_s)
            return None
        ready, _, _ = select.select([self._fd], [], [], timeout_s)
        if not ready:
            return None
        data = os.read(self._fd, 32)
        if not data:  # the terminal went away: nobody can press q any more
            return QUIT_KEYS[0]
        return data.decode(errors="replace")[:1]


@contextlib.contextmanager
def _keys() -> Iterator[_KeyReader]:
    """A key reader on stdin in cbreak mode (restored afterwards), if stdin is a terminal."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is None:
        yield _KeyReader(None)
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield _KeyReader(fd)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
