"""Reusable actor classes for the test suite.

They live in an importable module (``tests/`` is on ``sys.path`` through the rootdir conftest,
and procs inherit the client's ``sys.path``), so cloudpickle sends them by reference.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import os
import resource
import sys
import threading
import time
from typing import Any

import anyio

from mesh import Actor, context, current_rank, current_size, endpoint, this_host, this_proc
from mesh.testing import inbox_address

# -- exception types -------------------------------------------------------------------------


class CustomError(Exception):
    """A plain user exception type."""


class TwoArgError(Exception):
    """An exception whose constructor takes two arguments (the classic pickling trap)."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")
        self.code = code
        self.detail = detail


class FinalError(Exception):
    """A user exception that carries an unpicklable attribute."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def explode_on_load(where: str) -> None:
    """Used as a pickle reconstructor: unpickling the value raises."""
    raise RuntimeError(f"this value cannot be unpickled ({where})")


class FailsOnLoad:
    """Pickles fine, but cannot be unpickled."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __reduce__(self) -> tuple[Any, ...]:
        return explode_on_load, (self.where,)


# -- gates: let a test decide when a waiting endpoint may finish -------------------------------
#
# Module globals are per process, so a `Gate` actor spawned on the same procs as a `Waiter`
# can release it. No sleeps, no polling: pure message passing. Gate's endpoints are async: an
# event-loop event is set on the event loop (sync endpoints run on worker threads).

_gates: dict[str, anyio.Event] = {}


def _gate(name: str) -> anyio.Event:
    event = _gates.get(name)
    if event is None:
        event = _gates[name] = anyio.Event()
    return event


class Gate(Actor):
    @endpoint
    async def open(self, name: str) -> None:
        _gate(name).set()

    @endpoint
    async def reset(self, name: str) -> None:
        _gates.pop(name, None)


class Waiter(Actor):
    @endpoint
    async def wait(self, name: str, value: Any = None) -> Any:
        await _gate(name).wait()
        return value

    @endpoint
    async def wait_if_rank(self, name: str, rank: int, value: Any = None) -> Any:
        """Wait on the gate only on `rank` (in the called mesh); others answer at once."""
        if current_rank().rank == rank:
            await _gate(name).wait()
        return (current_rank().rank, value)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def ping(self) -> str:
        return "pong"


# -- basic actors ----------------------------------------------------------------------------


class Echo(Actor):
    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    @endpoint
    def echo(self, value: Any) -> Any:
        return value

    @endpoint
    def echo_kw(self, *args: Any, **kwargs: Any) -> Any:
        return self.prefix, args, kwargs

    @endpoint
    async def aecho(self, value: Any) -> Any:
        await anyio.lowlevel.checkpoint()
        return value

    @endpoint
    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def sys_path(self) -> list[str]:
        return list(sys.path)

    @endpoint
    def modules(self) -> list[str]:
        """The names of the modules this proc has loaded."""
        return sorted(sys.modules)

    @endpoint
    def frozen_objects(self) -> int:
        """How many objects the garbage collector leaves alone (`gc.freeze`)."""
        return gc.get_freeze_count()

    def helper(self) -> str:
        """A plain method, not an endpoint."""
        return "not callable remotely"


class EchoChild(Echo):
    """Overrides one endpoint, inherits the others."""

    @endpoint
    def echo(self, value: Any) -> Any:
        return ("child", value)


class PlainOverride(Echo):
    """Overrides an inherited endpoint with a plain method: `echo` is no endpoint here."""

    def echo(self, value: Any) -> Any:
        return ("plain override", value)


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.value = start

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.value += by
        return self.value

    @endpoint
    async def aincr(self, by: int = 1) -> int:
        await anyio.lowlevel.checkpoint()
        self.value += by
        return self.value

    @endpoint
    def get(self) -> int:
        return self.value

    @endpoint
    def pid_of(self) -> int:
        return os.getpid()

    @endpoint
    def fail_after_incr(self) -> int:
        self.value += 100
        raise CustomError(f"failed with value {self.value}")


class Raiser(Actor):
    def __init__(self) -> None:
        self.calls = 0

    @endpoint
    def raise_value_error(self, message: str) -> None:
        self.calls += 1
        raise ValueError(message)

    @endpoint
    async def araise_key_error(self, key: str) -> None:
        self.calls += 1
        await anyio.lowlevel.checkpoint()
        raise KeyError(key)

    @endpoint
    def raise_custom(self, message: str) -> None:
        self.calls += 1
        raise CustomError(message)

    @endpoint
    def raise_two_arg(self, code: int, detail: str) -> None:
        self.calls += 1
        raise TwoArgError(code, detail)

    @endpoint
    def raise_unpicklable(self, message: str) -> None:
        self.calls += 1
        raise FinalError(message)

    @endpoint
    def raise_on_rank(self, rank: int) -> int:
        self.calls += 1
        if current_rank().rank == rank:
            raise ValueError(f"rank {rank} refuses")
        return current_rank().rank

    @endpoint
    def raise_base(self) -> None:
        raise FatalSignal("not an Exception")

    @endpoint
    def count(self) -> int:
        return self.calls


class FatalSignal(BaseException):
    """A BaseException that is not an Exception: it fails the actor."""


class BrokenInit(Actor):
    def __init__(self, fail_on_rank: int | None = None) -> None:
        if fail_on_rank is None or current_rank().rank == fail_on_rank:
            raise RuntimeError("constructor refuses to start")

    @endpoint
    def ping(self) -> str:
        return "pong"


class Unpicklable(Actor):
    @endpoint
    def make_lock(self) -> Any:
        return threading.Lock()

    @endpoint
    def make_unloadable(self) -> Any:
        return FailsOnLoad("in the caller")

    @endpoint
    def ok(self) -> str:
        return "still alive"


class Printer(Actor):
    @endpoint
    def say(self, out: str, err: str) -> None:
        print(out)
        print(err, file=sys.stderr)

    @endpoint
    def partial(self, text: str) -> None:
        sys.stdout.write(text)  # no newline: flushed when the proc exits


class WhoAmI(Actor):
    def __init__(self) -> None:
        self.init_rank = dict(current_rank())
        self.init_size = current_size()

    @endpoint
    def whoami(self) -> dict[str, Any]:
        ctx = context()
        return {
            "rank": dict(current_rank()),
            "flat": current_rank().rank,
            "size": current_size(),
            "mesh_name": ctx.mesh_name,
            "actor_id": ctx.actor_id,
            "pid": ctx.pid,
            "os_pid": os.getpid(),
            "proc_id": ctx.proc_id,
            "host": ctx.host,
        }

    @endpoint
    async def awhoami(self) -> dict[str, Any]:
        await anyio.lowlevel.checkpoint()
        return {"rank": dict(current_rank()), "size": current_size()}

    @endpoint
    def init_info(self) -> dict[str, Any]:
        return {"rank": self.init_rank, "size": self.init_size}


# -- actors that use meshes ------------------------------------------------------------------


class Parent(Actor):
    """Spawns its own child proc mesh and calls it."""

    def __init__(self) -> None:
        self.children: Any = None
        self.procs: Any = None

    @endpoint
    def spawn_children(self, n: int) -> list[Any]:
        self.procs = this_host().spawn_procs(per_host={"kids": n}, name="kids")
        self.children = self.procs.spawn("children", WhoAmI)
        return [(dict(p), v["os_pid"]) for p, v in self.children.whoami.call().get(timeout=30)]

    @endpoint
    async def acall_children(self) -> list[int]:
        values = await self.children.whoami.call()
        return [v["flat"] for v in values.values()]

    @endpoint
    def call_children(self) -> list[int]:
        return [v["flat"] for v in self.children.whoami.call().get(timeout=30).values()]

    @endpoint
    def stop_children(self) -> None:
        self.procs.stop().get(timeout=30)


class Caller(Actor):
    """Takes a mesh handle as an argument and calls it."""

    def __init__(self, target: Any = None) -> None:
        self.target = target

    @endpoint
    def call_echo(self, target: Any, value: Any) -> list[Any]:
        return list(target.echo.call(value).get(timeout=30).values())

    @endpoint
    async def acall_echo(self, target: Any, value: Any) -> list[Any]:
        result = await target.echo.call(value)
        return list(result.values())

    @endpoint
    def call_stored(self, value: Any) -> list[Any]:
        return list(self.target.echo.call(value).get(timeout=30).values())

    @endpoint
    def call_incr(self, target: Any) -> int:
        return target.incr.call_one().get(timeout=30)

    @endpoint
    def call_raiser(self, target: Any, message: str) -> str:
        try:
            target.raise_value_error.call_one(message).get(timeout=30)
        except ValueError as exc:
            return f"caught {type(exc).__name__}: {exc}"
        return "no error"

    @endpoint
    def try_echo(self, target: Any, value: Any) -> tuple[str, Any]:
        """("ok", values) or ("error", "Type: message"): never raises."""
        try:
            return "ok", list(target.echo.call(value).get(timeout=30).values())
        except Exception as exc:
            return "error", f"{type(exc).__name__}: {exc}"

    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def call_with_timeout(self, target: Any, timeout: float) -> str:
        try:
            target.ping.call_one().get(timeout=timeout)
        except Exception as exc:
            return type(exc).__name__
        return "pong"


class Sleeper(Actor):
    """Endpoints that take a while without being hung."""

    @endpoint
    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)  # releases the GIL, like waiting on I/O
        return "slept"

    @endpoint
    def spin(self, seconds: float) -> int:
        deadline, count = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:  # pure-Python CPU work: the GIL is switched
            count += 1
        return count

    @endpoint
    def crunch(self, cpu_seconds: float) -> float:
        """At least `cpu_seconds` of CPU work in one C call that never lets the GIL go (so no
        heartbeat meanwhile), like a long native kernel; returns the CPU seconds it took."""
        sample = 5_000_000
        started = time.process_time()
        sum(range(sample))  # builtin sum over a range: a C loop, the GIL held throughout
        per_item = max(time.process_time() - started, 1e-4) / sample
        started = time.process_time()
        sum(range(int(cpu_seconds / per_item)))
        return time.process_time() - started


class LocalUser(Actor):
    """Spawns an actor in its own proc (this_proc) and calls it from its endpoints."""

    def __init__(self) -> None:
        self.local = this_proc().spawn("local", Counter, 100)

    @endpoint
    def bump(self) -> int:
        return self.local.incr.call_one().get(timeout=30)

    @endpoint
    async def abump(self) -> int:
        return await self.local.aincr.call_one()

    @endpoint
    def local_pid(self) -> tuple[int, int]:
        return os.getpid(), self.local.pid_of.call_one().get(timeout=30)

    @endpoint
    def abump_blocking(self, how: str) -> int:
        """A sync endpoint that blocks on an async endpoint of an actor in its own proc."""
        method = getattr(self.local.aincr, how)  # call_one, or choose (lands here: one rank)
        return method().get(timeout=10)


class AsyncioUser(Actor):
    """Sync endpoints that use asyncio the way libraries do: they need no running loop."""

    @endpoint
    def has_running_loop(self) -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    @endpoint
    def run_coroutine(self, value: Any) -> Any:
        async def later() -> Any:
            await asyncio.sleep(0)
            return value

        return asyncio.run(later())


class Where(Actor):
    """Says where it runs: its pid and its point."""

    @endpoint
    def where(self) -> tuple[int, dict[str, int]]:
        return os.getpid(), dict(current_rank())


# -- exit ------------------------------------------------------------------------------------


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


class _DelWitness:
    """Garbage in a reference cycle: only a garbage collection frees it (and runs __del__)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.cycle = self
        self.open = open  # at shutdown, module globals (builtins too) may be gone

    def __del__(self) -> None:
        self.open(self.path, "w").close()


class ExitWitness(Actor):
    """Leaves two files in `directory` when its proc exits normally: ``atexit-PID`` from an
    atexit handler, ``del-PID`` from a ``__del__`` that only the interpreter's shutdown runs
    (automatic garbage collection is off in this proc)."""

    def __init__(self, directory: str) -> None:
        gc.disable()
        atexit.register(_touch, os.path.join(directory, f"atexit-{os.getpid()}"))
        _DelWitness(os.path.join(directory, f"del-{os.getpid()}"))

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Exposed(Actor):
    """Says how a raw socket reaches it: its pid, its proc's inbox address and the id that
    calls address (its actor mesh's: the actor's id less its ``[rank]``)."""

    @endpoint
    def reach(self) -> tuple[int, str, str]:
        actor_id = context().actor_id or ""
        return os.getpid(), inbox_address(), actor_id.rsplit("[", 1)[0]

    @endpoint
    async def aping(self) -> int:
        """An async endpoint for raw calls: answers with this actor's rank."""
        await anyio.lowlevel.checkpoint()
        return current_rank().rank


def faults_of_allocations(mib: int, rounds: int) -> int:
    """Page faults of `rounds` buffers of `mib` MiB, each written whole and freed, after one
    more that faults its pages in whatever malloc does with them."""
    bytearray(mib << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        bytearray(mib << 20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


class Allocator(Actor):
    """Allocates and frees big buffers in an endpoint (on a worker thread)."""

    @endpoint
    def faults_of_allocations(self, mib: int, rounds: int) -> int:
        return faults_of_allocations(mib, rounds)

    @endpoint
    def huge_pages_of_a_tensor(self, mib: int) -> int:
        """KiB of transparent huge pages that a fresh torch tensor of `mib` MiB adds here."""
        import torch

        before = anon_huge_pages_kib()
        tensor = torch.ones(mib << 18)
        added = anon_huge_pages_kib() - before
        del tensor
        return added


def anon_huge_pages_kib() -> int:
    """This process's anonymous memory on transparent huge pages (AnonHugePages), in KiB."""
    with open("/proc/self/smaps_rollup") as rollup:
        line = next(line for line in rollup if line.startswith("AnonHugePages:"))
    return int(line.split()[1])
