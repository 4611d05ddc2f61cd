"""`Alarm`: a one-shot timer that one thread waits on and others arm without waking it.

The receiver's watch must look at a call only once it has run for a while. Waking the watch
at the start of each call cost every proc a thread wake-up per call (two, with the watch's
sleep); on Linux the alarm is a timerfd, armed and disarmed by one system call each, and the
waiting thread wakes only when it expires. Elsewhere arming wakes the waiting thread, which
then sleeps until the deadline.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Protocol

_CLOCK_MONOTONIC = 1
_TFD_CLOEXEC = 0o2000000


class Alarm(Protocol):
    """One timer: `wait` returns once it expires (or `ring` is called)."""

    def arm(self, seconds: float) -> None: ...
    def disarm(self) -> None: ...
    def ring(self) -> None: ...
    def wait(self) -> None: ...
    def close(self) -> None: ...


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _Itimerspec(ctypes.Structure):
    _fields_ = (("it_interval", _Timespec), ("it_value", _Timespec))


def _libc() -> ctypes.PyDLL | None:
    """libc with the timerfd calls (made holding the GIL: they never block), or None."""
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        libc.timerfd_create.restype = ctypes.c_int
        libc.timerfd_settime.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


class _TimerFdAlarm:
    """A Linux timerfd: arming and disarming are system calls that wake nobody (each one
    Python call: the receiver may arm and disarm it once per call)."""

    def __init__(self, libc: ctypes.PyDLL, fd: int) -> None:
        self._settime = libc.timerfd_settime
        self._fd = fd
        self._when = _Itimerspec()
        self._when_ref = ctypes.byref(self._when)
        self._when_s = -1.0  # the delay `_when` holds
        self._off_ref = ctypes.byref(_Itimerspec())

    def arm(self, seconds: float) -> None:
        if seconds != self._when_s:  # (the receiver arms it for the same delay each time)
            nanoseconds = max(1, int(seconds * 1e9))
            self._when.it_value.tv_sec, self._when.it_value.tv_nsec = divmod(nanoseconds, 10**9)
            self._when_s = seconds
        if self._settime(self._fd, 0, self._when_ref, None) != 0:
            _timerfd_failed()

    def disarm(self) -> None:
        if self._settime(self._fd, 0, self._off_ref, None) != 0:
            _timerfd_failed()

    def ring(self) -> None:
        self.arm(0)

    def wait(self) -> None:
        os.read(self._fd, 8)  # blocks until it expires (re-arming or disarming resets it)

    def close(self) -> None:
        os.close(self._fd)


def _timerfd_failed() -> None:
    raise OSError(ctypes.get_errno(), "timerfd_settime failed")


class _ConditionAlarm:
    """Without timerfd: arming wakes the waiting thread, which sleeps until the deadline."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._deadline: float | None = None

    def arm(self, seconds: float) -> None:
        with self._changed:
            self._deadline = time.monotonic() + seconds
            self._changed.notify()

    def disarm(self) -> None:
        with self._changed:
            self._deadline = None

    def ring(self) -> None:
        self.arm(0)

    def wait(self) -> None:
        with self._changed:
            while True:
                deadline = self._deadline
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._deadline = None
                    return
                self._changed.wait(left)

    def close(self) -> None:
        pass


def new_alarm() -> Alarm:
    """A disarmed alarm: a timerfd where the system has one."""
    if _LIBC is not None:
        fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, _TFD_CLOEXEC)
        if fd >= 0:
            return _TimerFdAlarm(_LIBC, fd)
    return _ConditionAlarm()
