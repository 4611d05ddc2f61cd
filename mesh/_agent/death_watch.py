"""Seeing a proc killed before the kernel has torn its memory down (issue 16).

The kernel makes a process's exit visible (`waitpid`, pidfds, sockets closing) only after it
has freed the process's memory: 0.1 to 0.5 s for 1 to 3 GB resident. But it releases the
robust mutexes a dying thread holds early in its exit, before that teardown. So each proc
forked by the fork server locks a robust, process-shared pthread mutex of its own as it starts
(in an anonymous shared mapping of the fork server: private to it and its procs, gone with
them), and a waiter process (`death_waiter`) waits on all of them. A released mutex is only a
hint (an ``exec`` releases it too, and a clean exit is left to the reap, after what the proc
said): a death is reported early only when the proc's ``/proc/PID/stat`` says it is exiting
(``PF_EXITING``), killed by a signal, and then with the status `waitpid` will return. A
stopped (SIGSTOP) or slow proc releases nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import pickle
import platform
import selectors
import signal
import socket
import sys

from mesh._agent import death_waiter as waiter
from mesh._agent.death_waiter import LIBC, PER_THREAD, PID, PID_AT, SLOT, SLOTS, syscall
from mesh._agent.output_relay import drain_relays

_PF_EXITING = 0x4
_SYSCALLS = {"x86_64": (202, 449), "aarch64": (98, 449)}  # futex, futex_waitv


def _syscalls() -> tuple[int, int] | None:
    """The numbers of futex and futex_waitv here, or None where futex_waitv is missing."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    ctypes.set_errno(0)
    syscall(numbers[1], None, 0, 0, None, 0)  # no futexes: EINVAL where it exists
    return numbers if ctypes.get_errno() == 22 else None


def dying_status(pid: int) -> int | None:
    """The `waitpid` status of process `pid` if it is exiting, killed by a signal; else None
    (running, stopped, exec'ing, ending by itself, or gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    if len(fields) < 50 or not int(fields[6]) & _PF_EXITING:
        return None
    status = int(fields[49])
    return status if status & 0x7F else None


#: Whether this kernel has futex_waitv (Linux 5.16+): without it a death is seen at the reap.
SEES_DEATHS_EARLY = _syscalls() is not None


class DeathWatch:
    """The fork server's robust mutexes, one per proc, and the process waiting on them."""

    def __init__(self) -> None:
        self._numbers = _syscalls()
        self._arena = mmap.mmap(-1, waiter.ARENA_BYTES, flags=mmap.MAP_SHARED)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._arena))
        self._attributes = ctypes.create_string_buffer(64)
        LIBC.pthread_mutexattr_init(self._attributes)
        LIBC.pthread_mutexattr_setpshared(self._attributes, 1)
        LIBC.pthread_mutexattr_setrobust(self._attributes, 1)
        self._free = list(range(SLOTS - 1, -1, -1))
        self._slots: dict[int, int] = {}  # pid -> its slot
        self._unseen: set[int] = set()  # ranges with procs to add at the next `commit`
        self._early: dict[int, int] = {}  # pid -> the status it was reported with
        self._read, write = os.pipe()
        self.waiter_pid, self.waiting = 0, True
        if self._numbers is not None:
            parent = os.getpid()
            self.waiter_pid = os.fork()
            if self.waiter_pid == 0:
                os.close(self._read)
                waiter.run_waiter(self._base, self._numbers, write, parent)
        os.close(write)
        os.set_blocking(self._read, False)

    def fileno(self) -> int:
        """Readable when a proc's mutex was released (`take` says which died)."""
        return self._read

    def close(self) -> None:
        """Stop the waiter (the fork server's dies with it) and close the pipe."""
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            if self.waiter_pid:
                os.kill(self.waiter_pid, signal.SIGKILL)
                os.waitpid(self.waiter_pid, 0)
        os.close(self._read)

    def arm(self) -> int | None:
        """A fresh mutex for the next proc to hold (its slot), or None (none free, no
        futex_waitv here: its death is seen when it is reaped)."""
        if self._numbers is None or not self._free:
            return None
        slot = self._free.pop()
        if LIBC.pthread_mutex_init(ctypes.c_void_p(self._address(slot)), self._attributes):
            self._free.append(slot)
            return None
        return slot

    def hold(self, slot: int | None) -> None:
        """In the proc just forked: lock the mutex of `slot` until this process ends, and wake
        its waiter (the kernel wakes a waiter of a dead owner's mutex only if one is marked)."""
        if slot is None or self._numbers is None:
            return
        address = self._address(slot)
        if LIBC.pthread_mutex_lock(ctypes.c_void_p(address)) != 0:
            return
        word = ctypes.c_uint32.from_address(address)
        word.value |= waiter.WAITERS  # only this thread writes the word while it lives
        syscall(self._numbers[0], address, waiter.FUTEX_WAKE, 1, None, None, 0)

    def watch(self, slot: int | None, pid: int | None) -> None:
        """Watch proc `pid`'s mutex of `slot` from the next `commit` (pid None: the fork
        failed, free the slot)."""
        if slot is None:
            return
        if pid is None:
            self._free.append(slot)
            return
        self._slots[pid] = slot
        ctypes.c_int32.from_address(self._address(slot) + PID_AT).value = pid
        self._unseen.add(slot // PER_THREAD)

    def commit(self) -> None:
        """Start watching the procs `watch` was given (once per batch of forks: one wake)."""
        if not self._unseen or self._numbers is None:
            return
        in_use = ctypes.c_uint32.from_address(waiter.control_address(self._base, waiter.RANGES))
        if max(self._unseen) >= in_use.value:  # the waiter starts a thread for a new range
            in_use.value = max(self._unseen) + 1
            self._wake(ctypes.addressof(in_use))
        for index in self._unseen:
            control = ctypes.c_uint32.from_address(waiter.control_address(self._base, index))
            control.value += 1
            self._wake(ctypes.addressof(control))
        self._unseen.clear()

    def take(self) -> list[tuple[int, int]]:
        """The procs whose mutex was released that are being killed: (pid, waitpid status)."""
        deaths = []
        with contextlib.suppress(BlockingIOError):
            data = os.read(self._read, PID.size * 8192)
            self.waiting = bool(data)  # end of file: the waiter was killed; reaps only now
            for (pid,) in PID.iter_unpack(data):
                status = dying_status(pid)
                if status is not None and pid in self._slots and pid not in self._early:
                    self._early[pid] = status
                    deaths.append((pid, status))
        return deaths

    def report(self, control: socket.socket, selector: selectors.BaseSelector) -> None:
        """Report on `control` the procs being killed now, before the kernel frees their
        memory and lets them be reaped; after the lines they wrote (relayed by `selector`'s
        relays): what a proc said comes before its exit."""
        dying = dict(self.take())
        if not self.waiting:
            selector.unregister(self._read)
        if dying:
            drain_relays(selector, lambda relay: relay.pid in dying)
        for pid, status in dying.items():
            control.send(pickle.dumps(("exited", pid, status)))

    def reaped(self, pid: int, status: int) -> bool:
        """Process `pid` was reaped with `status`: free its mutex; whether its exit is still
        to be reported (not reported early with that status; the waiter's is not a proc's)."""
        if pid in self._slots:
            slot = self._slots.pop(pid)
            ctypes.c_int32.from_address(self._address(slot) + PID_AT).value = 0
            self._free.append(slot)
        early = self._early.pop(pid, None)
        if early is not None and early != status:  # never seen: /proc said what waitpid says
            print(
                f"meshvisor fork server: proc {pid} was reported killed with status {early}, "
                f"then reaped with status {status}",
                file=sys.stderr,
            )
        return early is None and pid != self.waiter_pid

    def _wake(self, address: int) -> None:
        assert self._numbers is not None
        syscall(self._numbers[0], address, waiter.FUTEX_WAKE, 1, None, None, 0)

    def _address(self, slot: int) -> int:
        return self._base + slot * SLOT
