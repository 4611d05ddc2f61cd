"""A library of actors that fail in every way the supervision contract covers.

They live in an importable module (``tests/`` is on ``sys.path`` and procs inherit the
client's ``sys.path``), so cloudpickle sends them by reference.

Every destructive endpoint takes an optional ``rank``: only the actor at that rank (in the
mesh the call was sent to) misbehaves; the others answer with their rank. ``rank=None`` makes
every recipient misbehave.

`Owner` actors own proc meshes of their own and decide about their failures in
``__supervise__`` (sync in `SyncOwner`, async in `AsyncOwner`); every decision is appended
as one JSON line to a record file, so a test can read it even after the owner is gone.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import time
from typing import Any

import anyio

from mesh import Actor, Context, current_rank, endpoint, this_host
from mesh.testing import signal_this_process
from supervision import SupervisionError, SupervisionEvent


class ConstructorError(Exception):
    """What `Fragile.__init__` raises when asked to."""


class EndpointError(ValueError):
    """What the raising endpoints raise: a ValueError subclass with a custom name."""


class FatalError(BaseException):
    """A BaseException that is not an Exception."""


def _targeted(rank: int | None) -> bool:
    return rank is None or current_rank().rank == rank


def _no_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class Fragile(Actor):
    """A leaf actor with one endpoint per way of failing."""

    def __init__(
        self,
        fail_in_init: bool = False,
        fail_on_rank: int | None = None,
        base_in_init: bool = False,
    ) -> None:
        if fail_in_init and _targeted(fail_on_rank):
            if base_in_init:
                raise FatalError("constructor raised a BaseException")
            raise ConstructorError(f"constructor refuses on rank {current_rank().rank}")
        self.calls = 0

    # -- healthy ----------------------------------------------------------------------------

    @endpoint
    def ping(self) -> int:
        self.calls += 1
        return current_rank().rank

    @endpoint
    async def aping(self) -> int:
        await anyio.lowlevel.checkpoint()
        return current_rank().rank

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def count(self) -> int:
        return self.calls

    @endpoint
    def sleep(self, seconds: float) -> str:
        """Blocks the proc's event loop but releases the GIL: not a hang."""
        time.sleep(seconds)
        return "slept"

    @endpoint
    def nap(self, marker: str, seconds: float) -> str:
        """Sleeps like `sleep`, once it created the file `marker` (the caller knows when)."""
        with open(marker, "w"):
            pass
        time.sleep(seconds)
        return "slept"

    @endpoint
    async def park(self, seconds: float, rank: int | None = None) -> int:
        """Waits without blocking the proc (an in-flight call that only a failure ends)."""
        if _targeted(rank):
            await anyio.sleep(seconds)
        return current_rank().rank

    # -- exceptions -------------------------------------------------------------------------

    @endpoint
    def raise_error(self, message: str, rank: int | None = None) -> int:
        self.calls += 1
        if _targeted(rank):
            raise EndpointError(message)
        return current_rank().rank

    @endpoint
    async def araise_error(self, message: str, rank: int | None = None) -> int:
        await anyio.lowlevel.checkpoint()
        if _targeted(rank):
            raise KeyError(message)
        return current_rank().rank

    @endpoint
    def raise_base(self, kind: str = "FatalError", rank: int | None = None) -> int:
        if _targeted(rank):
            if kind == "SystemExit":
                raise SystemExit(7)
            if kind == "KeyboardInterrupt":
                raise KeyboardInterrupt
            raise FatalError("endpoint raised a BaseException")
        return current_rank().rank

    @endpoint
    async def araise_base(self, rank: int | None = None) -> int:
        await anyio.lowlevel.checkpoint()
        if _targeted(rank):
            raise SystemExit(9)
        return current_rank().rank

    # -- the process itself ----------------------------------------------------------------

    @endpoint
    def exit(self, code: int, rank: int | None = None) -> int:
        if _targeted(rank):
            os._exit(code)
        return current_rank().rank

    @endpoint
    def kill_self(self, signame: str, rank: int | None = None) -> int:
        if _targeted(rank):
            _no_core_dumps()
            signal_this_process(getattr(signal, signame))
            time.sleep(30)  # SIGTERM has a Python-level default; never answer normally
        return current_rank().rank

    @endpoint
    def fault(self, signame: str) -> int:
        """Raise the fatal signal `signame` in this thread (as a fault would: C's raise())."""
        _no_core_dumps()
        signal.raise_signal(getattr(signal, signame))
        return current_rank().rank

    @endpoint
    def segfault(self, rank: int | None = None) -> int:
        if _targeted(rank):
            _no_core_dumps()
            ctypes.string_at(0)  # a real invalid read
        return current_rank().rank

    @endpoint
    def hold_gil(self, seconds: int, rank: int | None = None) -> int:
        """Stall while holding the GIL: PyDLL does not release it, so heartbeats stop."""
        if _targeted(rank):
            ctypes.PyDLL(None).sleep(seconds)
        return current_rank().rank

    @endpoint
    def allocate(self, mib: int, rank: int | None = None) -> int:
        """Allocate and touch `mib` MiB, held until the call returns."""
        if _targeted(rank):
            _no_core_dumps()
            held = bytearray(mib << 20)
            for page in range(0, len(held), 4096):
                held[page] = 1
        return current_rank().rank

    @endpoint
    def stop_then_allocate(self, mib: int) -> int:
        """Stop this proc (SIGSTOP: its agent declares it hung), then, once continued,
        allocate `mib` MiB at once (zeroed by the kernel, not touched), past its memory limit."""
        signal_this_process(signal.SIGSTOP)
        return len(bytes(mib << 20))

    @endpoint
    def ignore_signal(self, signum: int) -> None:
        """Ignore `signum` from now on, at the C level (Python's signal() is main-thread only)."""
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(signum, ctypes.c_void_p(1))  # SIG_IGN

    @endpoint
    def data_limit(self) -> tuple[int, int]:
        """This proc's RLIMIT_DATA (what ``memory_limit`` sets) and its private writable memory
        now (``VmData``), in bytes."""
        with open("/proc/self/status") as status:
            vm_data = next(
                int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:")
            )
        return resource.getrlimit(resource.RLIMIT_DATA)[0], vm_data


def join_cgroup(path: str) -> None:
    """A proc mesh's bootstrap function: move this proc into the cgroup directory `path`."""
    with open(os.path.join(path, "cgroup.procs"), "w") as procs:
        procs.write(str(os.getpid()))


def refuse_rank_two() -> None:
    """A proc mesh's bootstrap function that fails to start rank 2 (the others start)."""
    if _targeted(2):
        raise RuntimeError("rank 2 has no GPU")


# -- owners ------------------------------------------------------------------------------------


def _event_summary(event: SupervisionEvent) -> dict[str, Any]:
    chain = []
    cause: SupervisionEvent | None = event
    while cause is not None:
        chain.append(cause.kind)
        cause = cause.cause
    return {
        "kind": event.kind,
        "mesh": event.mesh_name,
        "rank": dict(event.rank) if event.rank is not None else None,
        "signal": event.signal,
        "exit_code": event.exit_code,
        "message": event.message,
        "chain": chain,
    }


class OwnerBase(Actor):
    """Owns child meshes; `decision` is what ``__supervise__`` does: handle, ignore or raise.

    Every call of ``__supervise__`` appends ``{"level": ..., "event": {...}}`` to `record`.
    """

    def __init__(self, record: str, decision: str = "handle", level: int = 1) -> None:
        if decision not in ("handle", "ignore", "raise"):
            raise ValueError(f"unknown decision {decision!r}")
        self.record = record
        self.decision = decision
        self.level = level
        self.seen: list[SupervisionEvent] = []
        self.children: dict[str, tuple[Any, Any]] = {}
        self.child_owner: Any = None

    def _decide(self, event: SupervisionEvent) -> bool:
        self.seen.append(event)
        line = json.dumps(
            {"level": self.level, "decision": self.decision, "event": _event_summary(event)}
        )
        with open(self.record, "a") as f:
            f.write(line + "\n")
        if self.decision == "raise":
            raise RuntimeError(f"the handler at level {self.level} gives up")
        return self.decision == "handle"

    # -- child meshes -------------------------------------------------------------------------

    @endpoint
    def spawn_child(
        self, name: str, n: int, actor_class: type = Fragile, *args: Any, **kwargs: Any
    ) -> list[int]:
        """Spawn `n` procs and an `actor_class` mesh on them; the procs' pids.

        The pids come from a healthy `Fragile` mesh on the same procs ("<name>-probe"), so
        this works even when `actor_class` fails to construct."""
        procs = this_host().spawn_procs(per_host={"gpus": n}, name=f"{name}-procs")
        child = procs.spawn(name, actor_class, *args, **kwargs)
        self.children[name] = (procs, child)
        probe = procs.spawn(f"{name}-probe", Fragile)
        return list(probe.pid.call().get(timeout=30).values())

    @endpoint
    def call_child(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` on every actor of child `name`; a failure comes back as data."""
        _, child = self.children[name]
        try:
            return (
                "ok",
                list(getattr(child, method).call(*args, **kwargs).get(timeout=30).values()),
            )
        except SupervisionError as exc:
            return ("SupervisionError", exc.event.kind, str(exc))

    @endpoint
    def relay_child(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` on every actor of child `name`; its errors propagate to our caller."""
        _, child = self.children[name]
        return list(getattr(child, method).call(*args, **kwargs).get(timeout=30).values())

    @endpoint
    def broadcast_child(self, name: str, method: str, *args: Any, **kwargs: Any) -> None:
        _, child = self.children[name]
        getattr(child, method).broadcast(*args, **kwargs)

    @endpoint
    def stop_child(self, name: str) -> None:
        procs, _ = self.children[name]
        procs.stop().get(timeout=30)

    @endpoint
    def seen_events(self) -> list[SupervisionEvent]:
        return list(self.seen)

    # -- endpoints in progress while a child fails -----------------------------------------
    # Each first creates ``<record>.busy``: the test kills a child only once it exists.

    def _busy(self) -> None:
        with open(f"{self.record}.busy", "w"):
            pass

    @endpoint
    def poll_failure(self, timeout: float) -> str:
        """Poll (sync) until ``__supervise__`` has seen a failure: "seen", or "timed out"."""
        self._busy()
        deadline = time.monotonic() + timeout
        while not self.seen:
            if time.monotonic() > deadline:
                return "timed out"
            time.sleep(0.01)
        return "seen"

    @endpoint
    def hold(self, seconds: float) -> str:
        """Take `seconds` (sync), whatever happens meanwhile."""
        self._busy()
        time.sleep(seconds)
        return "timed out"

    @endpoint
    def set_decision(self, decision: str) -> None:
        self.decision = decision

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    # -- chains of owners ---------------------------------------------------------------------

    @endpoint
    def spawn_chain(
        self, decisions: list[tuple[str, bool]], record: str, hb: tuple[float, float] | None = None
    ) -> list[int]:
        """Below this owner: one more owner per entry of `decisions` ((decision, async)), then
        one `Fragile` leaf. Returns the pids below this owner, top-down (the leaf last)."""
        interval, timeout = hb or (None, None)
        procs = this_host().spawn_procs(
            per_host={"gpus": 1},
            name=f"level{self.level + 1}",
            heartbeat_interval_s=interval,
            heartbeat_timeout_s=timeout,
        )
        if decisions:
            (decision, is_async), rest = decisions[0], decisions[1:]
            cls = AsyncOwner if is_async else SyncOwner
            child = procs.spawn(f"owner{self.level + 1}", cls, record, decision, self.level + 1)
            self.child_owner = child
            pid = child.pid.call_one().get(timeout=30)
            below = child.spawn_chain.call_one(rest, record, hb).get(timeout=60)
        else:
            child = procs.spawn("leaf", Fragile)
            pid = child.pid.call_one().get(timeout=30)
            below = []
        self.children["chain"] = (procs, child)
        return [pid, *below]

    @endpoint
    def deep_ping(self) -> list[int]:
        """The levels of the chain from here down whose owners still answer."""
        alive = [self.level]
        if self.child_owner is not None:
            try:
                alive += self.child_owner.deep_ping.call_one().get(timeout=30)
            except SupervisionError:
                pass
        return alive


class SyncOwner(OwnerBase):
    def __supervise__(self, event: SupervisionEvent) -> bool:
        return self._decide(event)


class MonarchStyleOwner(OwnerBase):
    """Monarch's two-argument ``__supervise__(self, cx, failure)``."""

    contexts: list[str] = []

    def __supervise__(self, cx: Context, failure: SupervisionEvent) -> bool:
        self.contexts = [*self.contexts, type(cx).__name__]
        return self._decide(failure)

    @endpoint
    def seen_contexts(self) -> list[str]:
        return self.contexts


class AsyncOwner(OwnerBase):
    failure_seen: anyio.Event | None = None

    async def __supervise__(self, event: SupervisionEvent) -> bool:
        await anyio.lowlevel.checkpoint()
        if self.failure_seen is not None:
            self.failure_seen.set()
        return self._decide(event)

    @endpoint
    async def await_failure(self, seconds: float) -> str:
        """Wait (async) until ``__supervise__`` has seen a failure: "seen", or "timed out"."""
        self._busy()
        self.failure_seen = anyio.Event()
        with anyio.move_on_after(seconds):
            await self.failure_seen.wait()
            return "seen"
        return "timed out"

    @endpoint
    async def ahold(self, seconds: float) -> str:
        """Take `seconds` (async), whatever happens meanwhile."""
        self._busy()
        await anyio.sleep(seconds)
        return "timed out"


class NoHandlerOwner(OwnerBase):
    """An owner without ``__supervise__``: every child failure escalates."""


# -- replies that cannot be sent -----------------------------------------------------------------


class UnprintableError(Exception):
    """An exception whose ``str()`` itself raises."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ of UnprintableError is broken")


class BadReplies(Actor):
    """Endpoints whose return value or exception breaks the reply path, not the endpoint."""

    @endpoint
    def sized(self, nbytes: int) -> bytes:
        """A result of `nbytes` bytes (over MESHVISOR_MAX_MESSAGE_BYTES when that is lower)."""
        return b"x" * nbytes

    @endpoint
    def nested(self, depth: int) -> list[Any]:
        """A list nested `depth` deep: too deep to pickle, or even to repr."""
        value: list[Any] = []
        for _ in range(depth):
            value = [value]
        return value

    @endpoint
    def raise_unprintable(self) -> None:
        raise UnprintableError("the message is there, but str() cannot show it")

    @endpoint
    def ping(self) -> int:
        return current_rank().rank

    @endpoint
    def pid(self) -> int:
        return os.getpid()
