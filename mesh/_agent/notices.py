"""`NoticeWatch`: the host agent's notice signal (e.g. SLURM's ``--signal=USR1@60``), turned
into what the agent's loop can wait on.

The signal handler only writes a byte to a pipe the loop selects on. The loop then asks how much
time is left by running the time-left command (its output: a plain number of seconds) on a
thread, bounded, and reads the answer from the same pipe. Procs and the fork server ignore the
signal (a scheduler signals every process of the job step): they hear of it from their owner.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import shlex
import signal
import subprocess
import threading

#: Seconds the time-left command may take; the notice goes out without the time after that.
TIME_LEFT_TIMEOUT_S = 10.0

_SIGNALLED = b"s"
_ANSWERED = b"a"


def notice_signal(name: str) -> signal.Signals:
    """The signal named `name` (``USR1``, ``SIGUSR1`` or a number); ValueError if none is."""
    text = name.strip().upper()
    if text.isdigit():
        return signal.Signals(int(text))
    try:
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except KeyError:
        raise ValueError(f"{name!r} names no signal (e.g. USR1, SIGUSR2 or 10)") from None


def parse_seconds(text: str) -> float | None:
    """The time-left command's output as seconds: a plain, finite, non-negative number, else
    None (unknown)."""
    try:
        seconds = float(text.strip())
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class EarlyNotice:
    """The notice signal's handler from the agent program's first steps until its watch is
    installed: a notice that comes while the agent imports and starts (a step's signal can come
    at once) is kept for the watch instead of ending the process (the signal's default)."""

    def __init__(self) -> None:
        self.heard = False

    def __call__(self, *_: object) -> None:
        self.heard = True


def hold_early_notices(argv: list[str]) -> None:
    """Handle the notice signal that `argv` (``meshvisor agent``'s options) names with an
    `EarlyNotice` now, before the agent's imports; a bad name is left to its parser."""
    name = next((a.partition("=")[2] for a in argv if a.startswith("--notice-signal=")), None)
    if "--notice-signal" in argv[:-1]:
        name = argv[argv.index("--notice-signal") + 1]
    if name is None:
        return
    with contextlib.suppress(ValueError, OSError):
        signal.signal(notice_signal(name), EarlyNotice())


def _heard_early(handler: object) -> bool:
    return isinstance(handler, EarlyNotice) and handler.heard


class NoticeWatch:
    """The notice signal of one agent: `fileno` becomes readable when something happened, and
    `take` gives the notices that are complete, as (signal name, seconds left or None)."""

    def __init__(self, signum: signal.Signals, time_left_command: str | None = None) -> None:
        self.signum = signum
        self._command = shlex.split(time_left_command) if time_left_command else None
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._answers: queue.SimpleQueue[float | None] = queue.SimpleQueue()
        self._asking = False
        self._early = False  # a notice heard before the watch was installed

    def ignore_in_children(self) -> None:
        """Ignore the signal in this process and what it forks from now on (the fork server,
        procs); call `install` after the forks that must keep ignoring it."""
        self._early |= _heard_early(signal.signal(self.signum, signal.SIG_IGN))

    def install(self) -> None:
        """Handle the signal in this (the agent's) process, and a notice heard before."""
        self._early |= _heard_early(signal.signal(self.signum, self._on_signal))
        if self._early:
            self._on_signal()

    def fileno(self) -> int:
        return self._read

    def take(self) -> list[tuple[str, float | None]]:
        """The notices complete since last time; starts asking the time left for new ones."""
        try:
            data = os.read(self._read, 4096)
        except BlockingIOError:
            data = b""
        notices: list[tuple[str, float | None]] = []
        name = self.signum.name
        if _SIGNALLED in data:
            if self._command is None:
                notices.append((name, None))
            elif not self._asking:  # signals while it asks are the same notice
                self._asking = True
                threading.Thread(target=self._ask, name="time-left", daemon=True).start()
        while not self._answers.empty():
            self._asking = False
            notices.append((name, self._answers.get()))
        return notices

    def close(self) -> None:
        signal.signal(self.signum, signal.SIG_IGN)  # a late notice must not kill the agent
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _on_signal(self, *_: object) -> None:
        with contextlib.suppress(OSError):
            os.write(self._write, _SIGNALLED)

    def _ask(self) -> None:
        """Thread: run the time-left command; its answer (None if it failed) to the loop."""
        assert self._command is not None
        seconds = None
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run(
                self._command,
                capture_output=True,
                text=True,
                timeout=TIME_LEFT_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
            if done.returncode == 0:
                seconds = parse_seconds(done.stdout)
        self._answers.put(seconds)
        with contextlib.suppress(OSError):
            os.write(self._write, _ANSWERED)
