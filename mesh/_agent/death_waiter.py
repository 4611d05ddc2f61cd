"""The death watch's waiter: a small process the fork server forks first, whose threads wait
on the procs' robust mutexes (`death_watch`), so that the fork server itself stays
single-threaded (a thread there would leave its malloc arena to every proc it forks).

Everything it needs lies in the shared arena: per slot a mutex and the pid of the proc that
holds it (0: none), per range of `PER_THREAD` slots a control word the fork server bumps and
wakes when it adds procs to that range, and the number of ranges in use. One thread per range
waits on its control word and its procs' mutexes at once (``futex_waitv`` takes 128 futexes),
and writes the pid of each proc whose mutex the kernel released to the fork server's pipe.
"""

from __future__ import annotations

import ctypes
import os
import signal
import struct
import threading
from typing import NoReturn

SLOT = 64  # bytes per slot: a pthread_mutex_t (40 or 48 bytes), then the pid at `PID_AT`
PID_AT = 56
PER_THREAD = 127  # futex_waitv takes 128 futexes: a range's procs and its control word
RANGES = 32
SLOTS = RANGES * PER_THREAD  # procs alive at once that can have one; others: the reap only
#: The size of the arena: the slots, a control word per range, the number of ranges in use.
ARENA_BYTES = SLOTS * SLOT + 4 * RANGES + 4
OWNER_DIED, WAITERS = 0x40000000, 0x80000000
FUTEX_WAKE, FUTEX2_U32 = 1, 2
PID = struct.Struct("q")
#: The waiter's process name (``/proc/PID/comm``): tools that count a fork server's children
#: as procs leave it out.
WAITER_NAME = "meshvisor-death"
_PR_SET_NAME = 15
LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1


class FutexWaitv(ctypes.Structure):
    _fields_ = (
        ("val", ctypes.c_uint64),
        ("uaddr", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    )


def syscall(*args: int | None) -> int:
    """syscall(2) with every argument a long (or NULL); its errors (EAGAIN: a futex's value
    changed, EINTR) only mean: look again."""
    return int(LIBC.syscall(*(None if a is None else ctypes.c_long(a) for a in args)))


def word(address: int) -> int:
    return ctypes.c_uint32.from_address(address).value


def control_address(base: int, index: int) -> int:
    """The control word of range `index` (`RANGES`: the number of ranges in use)."""
    return base + SLOTS * SLOT + 4 * index


def run_waiter(base: int, numbers: tuple[int, int], notify: int, parent: int) -> NoReturn:
    """The waiter process: a thread per range in use, started as ranges come into use; it
    dies with the fork server (process `parent`)."""
    LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(0)
    LIBC.prctl(_PR_SET_NAME, ctypes.c_char_p(WAITER_NAME.encode()))
    os.closerange(3, notify)  # what the fork server holds is not its own to keep open
    os.closerange(notify + 1, os.sysconf("SC_OPEN_MAX"))
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    in_use = control_address(base, RANGES)
    started = 0
    while True:
        wanted = word(in_use)
        for index in range(started, min(wanted, RANGES)):
            waiter = _RangeWaiter(base, index, numbers[1], notify)
            threading.Thread(target=waiter.run, daemon=True).start()
        started = max(started, min(wanted, RANGES))
        syscall(numbers[0], in_use, 0, wanted, None, None, 0)  # FUTEX_WAIT, shared


class _RangeWaiter:
    """Waits on the procs of one range of slots."""

    def __init__(self, base: int, index: int, waitv: int, notify: int) -> None:
        self._slots = [
            base + slot * SLOT for slot in range(index * PER_THREAD, (index + 1) * PER_THREAD)
        ]
        self._control = control_address(base, index)
        self._waitv, self._notify = waitv, notify
        self._told: dict[int, int] = {}  # mutex address -> the pid reported released

    def run(self) -> None:
        while True:
            control = word(self._control)
            watched = []
            for address in self._slots:
                pid = word(address + PID_AT)
                if not pid or self._told.get(address) == pid:
                    continue
                if word(address) & OWNER_DIED:
                    self._told[address] = pid
                    os.write(self._notify, PID.pack(pid))
                else:
                    watched.append(address)
            self._wait(control, watched)

    def _wait(self, control: int, watched: list[int]) -> None:
        """Sleep until a watched mutex or the control word changes (at once if one did)."""
        waiters = (FutexWaitv * (1 + len(watched)))()
        waiters[0] = FutexWaitv(control, self._control, FUTEX2_U32, 0)
        for index, address in enumerate(watched, 1):
            waiters[index] = FutexWaitv(word(address), address, FUTEX2_U32, 0)
        syscall(self._waitv, ctypes.addressof(waiters), len(waiters), 0, None, 0)
