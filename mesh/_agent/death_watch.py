"""Seeing a proc killed before the kernel has torn its memory down (issue 16).

The kernel makes a process's exit visible (`waitpid`, pidfds, sockets closing) only after it
has freed the process's memory: 0.1 to 0.5 s for 1 to 3 GB resident. But it releases the
robust mutexes a dying thread holds early in its exit, before that teardown. So each proc
forked by the fork server locks a robust, process-shared pthread mutex of its own as it starts
(in an anonymous shared mapping of the fork server: private to it and its procs, gone with
them), and one thread of the fork server per 127 procs waits on all their mutexes at once
(``futex_waitv``). A released mutex is only a hint (an ``exec`` releases it too, and a clean
exit is left to the reap, after what the proc said): a death is reported early only when the
proc's ``/proc/PID/stat`` says it is exiting (``PF_EXITING``), killed by a signal, and then
with the status `waitpid` will return. A stopped (SIGSTOP) or slow proc releases nothing.
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
import struct
import sys
import threading

from mesh._agent.output_relay import drain_relays

_SLOT = 64  # bytes per mutex (a pthread_mutex_t is 40 or 48)
_PER_THREAD = 127  # futex_waitv takes 128 futexes: a thread's procs and its control word
_SLOTS = 32 * _PER_THREAD  # procs alive at once that can have one; others: the reap only
_OWNER_DIED, _WAITERS = 0x40000000, 0x80000000
_PF_EXITING = 0x4
_SYSCALLS = {"x86_64": (202, 449), "aarch64": (98, 449)}  # futex, futex_waitv
_FUTEX_WAKE, _FUTEX_PRIVATE = 1, 128
_FUTEX2_U32, _FUTEX2_PRIVATE = 2, 128
_PID = struct.Struct("q")
_LIBC = ctypes.CDLL(None, use_errno=True)


class _FutexWaitv(ctypes.Structure):
    _fields_ = (
        ("val", ctypes.c_uint64),
        ("uaddr", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    )


def _syscalls() -> tuple[int, int] | None:
    """The numbers of futex and futex_waitv here, or None where futex_waitv is missing."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    ctypes.set_errno(0)
    _syscall(numbers[1], None, 0, 0, None, 0)  # no futexes: EINVAL where it exists
    return numbers if ctypes.get_errno() == 22 else None


def _syscall(*args: int | None) -> int:
    """syscall(2) with every argument a long (or NULL); its errors (EAGAIN: a futex's value
    changed, EINTR) only mean: look again."""
    return int(_LIBC.syscall(*(None if a is None else ctypes.c_long(a) for a in args)))


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


class _Watcher:
    """A thread that waits on up to `_PER_THREAD` mutexes and writes the pid of each proc
    whose mutex the kernel released to `notify`."""

    def __init__(self, numbers: tuple[int, int], notify: int) -> None:
        self._futex, self._waitv = numbers
        self._notify = notify
        self._control = ctypes.c_uint32(0)  # bumped (and woken) when the set changes
        self._lock = threading.Lock()
        self.watched: dict[int, int] = {}  # mutex address -> pid
        threading.Thread(target=self._run, name="meshvisor-deaths", daemon=True).start()

    def change(self, address: int, pid: int | None) -> None:
        """Watch the mutex at `address` for proc `pid` (None: stop watching it), from the
        next `wake` (its slots are its own: a wait left on a freed one wakes only itself)."""
        with self._lock:
            if pid is None:
                self.watched.pop(address, None)
            else:
                self.watched[address] = pid

    def wake(self) -> None:
        """Make it wait on the mutexes it watches now."""
        self._control.value += 1
        wake = _FUTEX_WAKE | _FUTEX_PRIVATE
        _syscall(self._futex, ctypes.addressof(self._control), wake, 1, None, None, 0)

    def _run(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # the main thread's
        while True:
            control = self._control.value
            with self._lock:
                watched = dict(self.watched)
            for address, pid in watched.items():
                if ctypes.c_uint32.from_address(address).value & _OWNER_DIED:
                    with self._lock:  # unless its slot serves another proc already
                        if self.watched.get(address) == pid:
                            del self.watched[address]
                    os.write(self._notify, _PID.pack(pid))
            self._wait(control)

    def _wait(self, control: int) -> None:
        """Sleep until a watched mutex or the control word changes (at once if one did)."""
        with self._lock:
            addresses = list(self.watched)
        waiters = (_FutexWaitv * (1 + len(addresses)))()
        private = _FUTEX2_U32 | _FUTEX2_PRIVATE
        waiters[0] = _FutexWaitv(control, ctypes.addressof(self._control), private, 0)
        for index, address in enumerate(addresses, 1):
            value = ctypes.c_uint32.from_address(address).value
            waiters[index] = _FutexWaitv(value, address, _FUTEX2_U32, 0)
        _syscall(self._waitv, ctypes.addressof(waiters), len(waiters), 0, None, 0)


class DeathWatch:
    """The fork server's robust mutexes, one per proc, and the threads waiting on them."""

    def __init__(self) -> None:
        self._numbers = _syscalls()
        self._arena = mmap.mmap(-1, _SLOT * _SLOTS, flags=mmap.MAP_SHARED)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._arena))
        self._attributes = ctypes.create_string_buffer(64)
        _LIBC.pthread_mutexattr_init(self._attributes)
        _LIBC.pthread_mutexattr_setpshared(self._attributes, 1)
        _LIBC.pthread_mutexattr_setrobust(self._attributes, 1)
        self._free = list(range(_SLOTS - 1, -1, -1))
        self._slots: dict[int, int] = {}  # pid -> its slot
        self._watchers: dict[int, _Watcher] = {}  # by slot // _PER_THREAD: the slots it owns
        self._unseen: set[_Watcher] = set()  # those with procs to add at the next `commit`
        self._early: dict[int, int] = {}  # pid -> the status it was reported with
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)

    def fileno(self) -> int:
        """Readable when a proc's mutex was released (`take` says which died)."""
        return self._read

    def fds(self) -> tuple[int, int]:
        """Its descriptors (a proc closes them)."""
        return self._read, self._write

    def arm(self) -> int | None:
        """A fresh mutex for the next proc to hold (its slot), or None (none free, no
        futex_waitv here: its death is seen when it is reaped)."""
        if self._numbers is None or not self._free:
            return None
        slot = self._free.pop()
        if _LIBC.pthread_mutex_init(ctypes.c_void_p(self._address(slot)), self._attributes):
            self._free.append(slot)
            return None
        return slot

    def hold(self, slot: int | None) -> None:
        """In the proc just forked: lock the mutex of `slot` until this process ends, and wake
        its watcher (the kernel wakes a waiter of a dead owner's mutex only if one is marked)."""
        if slot is None:
            return
        address = self._address(slot)
        if _LIBC.pthread_mutex_lock(ctypes.c_void_p(address)) != 0 or self._numbers is None:
            return
        word = ctypes.c_uint32.from_address(address)
        word.value |= _WAITERS  # only this thread writes the word while it lives
        _syscall(self._numbers[0], address, _FUTEX_WAKE, 1, None, None, 0)

    def watch(self, slot: int | None, pid: int | None) -> None:
        """Watch proc `pid`'s mutex of `slot` (pid None: the fork failed, free the slot)."""
        if slot is None:
            return
        if pid is None:
            self._free.append(slot)
            return
        assert self._numbers is not None  # `arm` gave a slot
        watcher = self._watchers.get(slot // _PER_THREAD)
        if watcher is None:
            watcher = self._watchers[slot // _PER_THREAD] = _Watcher(self._numbers, self._write)
        self._slots[pid] = slot
        watcher.change(self._address(slot), pid)
        self._unseen.add(watcher)

    def commit(self) -> None:
        """Start watching the procs `watch` was given (once per batch of forks: one wake)."""
        for watcher in self._unseen:
            watcher.wake()
        self._unseen.clear()

    def take(self) -> list[tuple[int, int]]:
        """The procs whose mutex was released that are being killed: (pid, waitpid status)."""
        deaths = []
        with contextlib.suppress(BlockingIOError):
            data = os.read(self._read, 8 * _PID.size * 1024)
            for (pid,) in _PID.iter_unpack(data):
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
        if dying:
            drain_relays(selector, lambda relay: relay.pid in dying)
        for pid, status in dying.items():
            control.send(pickle.dumps(("exited", pid, status)))

    def reaped(self, pid: int, status: int) -> bool:
        """Proc `pid` was reaped with `status`: free its mutex; whether its exit is still to
        be reported (not reported early with that status)."""
        if pid in self._slots:
            slot = self._slots.pop(pid)
            self._watchers[slot // _PER_THREAD].change(self._address(slot), None)
            self._free.append(slot)
        early = self._early.pop(pid, None)
        if early is not None and early != status:  # never seen: /proc said what waitpid says
            print(
                f"meshvisor fork server: proc {pid} was reported killed with status {early}, "
                f"then reaped with status {status}",
                file=sys.stderr,
            )
        return early is None

    def _address(self, slot: int) -> int:
        return self._base + slot * _SLOT
