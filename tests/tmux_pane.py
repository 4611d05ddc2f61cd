"""A real terminal for tests of terminal tools: one tmux session of a fixed size on a private
tmux server (its socket in the test session's private base), driven as a person would: run a
command, read the screen, press keys. The server is killed when the pane is closed."""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping

from conftest import RUN_BASE

_names = itertools.count()
T = 60.0


class TmuxPane:
    """The one pane of a detached tmux session running `command`."""

    def __init__(self, socket: str) -> None:
        self.socket = socket

    def tmux(self, *args: str) -> subprocess.CompletedProcess[str]:
        # without the sizes of the terminal running the tests: programs would believe them
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")}
        command = ["tmux", "-S", self.socket, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=30, env=env)

    def start(
        self, command: list[str], env: Mapping[str, str], width: int = 200, height: int = 60
    ) -> None:
        """Run `command` (with `env` added) in a new session of `width` x `height` cells."""
        flags = [item for name, value in env.items() for item in ("-e", f"{name}={value}")]
        size = ["-x", str(width), "-y", str(height)]
        line = shlex.join(command)
        done = self.tmux("new-session", "-d", "-s", "view", *size, *flags, line)
        assert done.returncode == 0, f"tmux could not start {line!r}: {done.stderr}"
        self.tmux("set-option", "-t", "view", "remain-on-exit", "on")

    def screen(self) -> str:
        """What the pane shows now (empty once the session is gone)."""
        return self.tmux("capture-pane", "-p", "-t", "view").stdout

    def press(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "view", *keys)

    def command_ended(self) -> bool:
        """Whether the command in the pane has exited (the pane stays, dead, to be read)."""
        shown = self.tmux("display-message", "-p", "-t", "view", "#{pane_dead}").stdout
        return shown.strip() == "1"

    def wait_for(self, condition: Callable[[str], bool], what: str, timeout: float = T) -> str:
        """The screen once `condition(screen)` holds; AssertionError showing it otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            shown = self.screen()
            if condition(shown):
                return shown
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}:\n{shown}")
            time.sleep(0.1)


@contextlib.contextmanager
def tmux_pane() -> Iterator[TmuxPane]:
    """A private tmux server for one test, killed (with what runs in it) afterwards."""
    socket = os.path.join(RUN_BASE, f"tmux-{os.getpid()}-{next(_names)}")
    pane = TmuxPane(socket)
    try:
        yield pane
    finally:
        pane.tmux("kill-server")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket)
