"""A meshvisor client run as a subprocess by tests/test_failfast.py: ``python failfast_client.py
SCENARIO [ARG]``.

Fail-fast raises in the client's main thread, so these scenarios run in their own process
instead of inside pytest. Each prints lines the test parses:

- ``PIDS <json>``: every process of this job (host agent, fork server, procs), printed once
  the procs are up, so the test can check that none survives the client (printed again if
  the job changes; the last line counts);
- ``PROCS <json>``: the pids of the procs of the ``workers`` mesh, in rank order;
- ``RESULT <json>``: what the scenario observed;
- ``HOOK <json>``: an event the global unhandled-failure hook was given;
- ``ATEXIT``: printed by an atexit handler (fail-fast must let atexit handlers run).

Bounded everywhere: a scenario that waits for a failure waits at most ``WAIT_S`` seconds and
then exits with status 3 ("nothing happened"), which the tests treat as a failure. Scenarios
that catch a failure also say whether it came ``early`` (well before that bound), so that a
failure raised only when the wait ends on its own is not mistaken for an interruption.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the actors

import anyio
import failing_actors as fa

import supervision
from mesh import supervised, this_host
from supervision import SupervisionError, SupervisionEvent

WAIT_S = 10.0  # a failure interrupts waits within milliseconds; this only bounds a bug
T = 30.0
HB = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0}


def emit(tag: str, value: Any) -> None:
    print(f"{tag} {json.dumps(value)}", flush=True)


def job_pids() -> list[int]:
    """This client's host agent, its fork server and its procs (they share the agent's
    command line, which names the client as ``--owner-pid``)."""
    mine = ["--owner-pid", str(os.getpid())]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        pairs = list(itertools.pairwise(argv))
        if tuple(mine) in pairs:
            found.append(int(entry.name))
    return sorted(found)


def agent_pid() -> int:
    """The host agent itself: the job process whose parent is this client."""
    for pid in job_pids():
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid():
            return pid
    raise AssertionError("no host agent found for this client")


def describe(event: SupervisionEvent) -> dict[str, Any]:
    return {
        "kind": event.kind,
        "mesh": event.mesh_name,
        "rank": dict(event.rank) if event.rank is not None else None,
        "pid": event.pid,
        "host": event.host,
        "signal": event.signal,
        "exit_code": event.exit_code,
        "str": str(event),
        "cause": describe(event.cause) if event.cause is not None else None,
    }


def start(n: int = 2, name: str = "workers", **kwargs: Any) -> tuple[Any, Any, list[int]]:
    procs = this_host().spawn_procs(per_host={"gpus": n}, name=name, **kwargs)
    workers = procs.spawn(f"{name}-actors", fa.Fragile)
    pids = list(workers.pid.call().get(timeout=T).values())
    emit("PROCS", pids)
    emit("PIDS", job_pids())
    return procs, workers, pids


def wait_forever() -> None:
    """Block the main thread in a plain sleep (only fail-fast can end it early)."""
    time.sleep(WAIT_S)
    emit("RESULT", {"interrupted": False})
    sys.exit(3)


class SlowToPickle:
    """Pickles as the number `WAIT_S` after running Python code for `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> tuple[type[float], tuple[float]]:
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline:
            pass
        return float, (WAIT_S,)


# -- scenarios -----------------------------------------------------------------------------------


def blocked_get() -> None:
    """The main thread waits on the very call that fails: that get() raises."""
    _, workers, pids = start()
    started = time.monotonic()
    try:
        workers.slice(gpus=1).kill_self.call_one("SIGKILL").get(timeout=WAIT_S)
    except SupervisionError as exc:
        early = time.monotonic() - started < WAIT_S / 2
        survivor = workers.slice(gpus=0).ping.call_one().get(timeout=T)
        emit(
            "RESULT",
            {"event": describe(exc.event), "early": early, "survivor": survivor, "pid": pids[1]},
        )
        return
    sys.exit(3)


def interrupt(region: str) -> None:
    """No call is waiting: the failure interrupts whatever the main thread is doing."""
    procs, workers, pids = start()
    other = procs.spawn("other", fa.Fragile)
    started = time.monotonic()
    try:
        os.kill(pids[1], signal.SIGKILL)
        if region == "sleep":
            time.sleep(WAIT_S)
        elif region == "event_wait":
            threading.Event().wait(WAIT_S)
        elif region == "busy":
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                pass
        elif region == "other_call":  # blocked on a call the failure does not concern
            other.slice(gpus=0).park.call_one(WAIT_S).get(timeout=WAIT_S + 5)
        elif region == "pickling":  # the failure lands while an argument is being pickled
            other.slice(gpus=0).park.call_one(SlowToPickle(1.0)).get(timeout=WAIT_S + 5)
        emit("RESULT", {"interrupted": False})
        sys.exit(3)
    except SupervisionError as exc:
        caught = exc
    early = time.monotonic() - started < WAIT_S / 2
    # Catching it is handling it: the program goes on and the healthy rank still answers.
    survivor = workers.slice(gpus=0).ping.call_one().get(timeout=T)
    emit(
        "RESULT",
        {
            "event": describe(caught.event),
            "survivor": survivor,
            "type": type(caught).__name__,
            "early": early,
        },
    )


def uncaught(kind: str) -> None:
    """Nothing catches the failure: status 1, a report, atexit handlers, nothing left."""
    atexit.register(lambda: print("ATEXIT", flush=True))
    _, workers, pids = start(**(HB if kind == "hung" else {}))
    if kind == "sigkill":
        os.kill(pids[1], signal.SIGKILL)
    elif kind == "exit0":
        workers.slice(gpus=1).exit.broadcast(0)
    elif kind == "broadcast_raise":
        workers.slice(gpus=1).raise_error.broadcast("nobody hears this")
    elif kind == "hung":
        os.kill(pids[1], signal.SIGSTOP)
    wait_forever()


def uncaught_in_get() -> None:
    """The failing call's own get() raises and nothing catches it."""
    atexit.register(lambda: print("ATEXIT", flush=True))
    _, workers, _ = start()
    workers.slice(gpus=0).segfault.call_one().get(timeout=WAIT_S)
    sys.exit(3)


def uncaught_actor_error() -> None:
    """An endpoint raises and nothing catches the ActorError: the program dies of it."""
    atexit.register(lambda: print("ATEXIT", flush=True))
    _, workers, _ = start()
    workers.slice(gpus=1).raise_error.call_one("no such input").get(timeout=T)
    sys.exit(3)


def escalated(record: str) -> None:
    """A two-level tree whose owners both decline: the root report shows the whole path."""
    atexit.register(lambda: print("ATEXIT", flush=True))
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="level1")
    owner = procs.spawn("owner1", fa.SyncOwner, record, "ignore", 1)
    chain = owner.spawn_chain.call_one([("ignore", True)], record).get(timeout=T)
    emit("PIDS", job_pids())
    os.kill(chain[-1], signal.SIGKILL)
    wait_forever()


def hook(decision: str) -> None:
    """The global unhandled-failure hook sees root failures; truthy handles them."""
    atexit.register(lambda: print("ATEXIT", flush=True))
    seen: list[SupervisionEvent] = []
    called = threading.Event()

    def on_unhandled(event: SupervisionEvent) -> bool:
        emit("HOOK", describe(event))  # before deciding: a decline interrupts the main thread
        seen.append(event)
        called.set()
        return decision == "handle"

    previous = supervision.set_unhandled_failure_hook(on_unhandled)
    assert previous is None
    _, workers, pids = start()
    os.kill(pids[1], signal.SIGKILL)
    if not called.wait(WAIT_S):
        sys.exit(3)
    survivor = workers.slice(gpus=0).ping.call_one().get(timeout=T)
    emit("RESULT", {"events": [describe(e) for e in seen], "survivor": survivor})
    if decision == "handle":
        assert supervision.set_unhandled_failure_hook(None) is on_unhandled
        return
    wait_forever()  # declined: fail-fast still raises


def on_failure(decision: str) -> None:
    """A handler on the mesh decides first; the global hook only sees what it declines."""
    atexit.register(lambda: print("ATEXIT", flush=True))
    order: list[str] = []
    done = threading.Event()

    def mesh_handler(event: SupervisionEvent) -> Any:
        order.append(f"mesh:{event.kind}")
        if decision == "raise":
            raise RuntimeError("the mesh handler broke")
        if decision == "handle":
            done.set()
        return decision == "handle"

    def global_hook(event: SupervisionEvent) -> bool:
        order.append(f"hook:{event.kind}")
        done.set()
        return True

    supervision.set_unhandled_failure_hook(global_hook)
    procs, workers, pids = start()
    procs.on_failure(mesh_handler)
    os.kill(pids[0], signal.SIGKILL)
    if not done.wait(WAIT_S):
        sys.exit(3)
    survivor = workers.slice(gpus=1).ping.call_one().get(timeout=T)
    emit("RESULT", {"order": order, "survivor": survivor})


def client_killed() -> None:
    """The test SIGKILLs this client once the PIDS line is out."""
    start()
    wait_forever()


def agent_killed() -> None:
    """The local host agent dies: every proc it ran is reported unreachable, once."""
    _, workers, pids = start()
    agent = agent_pid()
    caught: list[SupervisionEvent] = []
    deadline = time.monotonic() + WAIT_S
    try:
        os.kill(agent, signal.SIGKILL)
        time.sleep(WAIT_S)
    except SupervisionError as exc:
        caught += [exc.event, *exc.related_events]
    early = deadline - time.monotonic() > WAIT_S / 2
    # One agent loss fails every rank; each must be delivered once (maybe in one error).
    while len(caught) < len(pids) and time.monotonic() < deadline:
        try:
            time.sleep(0.01)
        except SupervisionError as exc:
            caught += [exc.event, *exc.related_events]
    try:
        workers.ping.call().get(timeout=T)
        later = "answered"
    except SupervisionError as exc:
        later = exc.event.kind
    # A new agent is started on demand and serves new procs.
    fresh = this_host().spawn_procs(per_host={"gpus": 2}, name="fresh").spawn("f", fa.Fragile)
    respawned = list(fresh.ping.call().get(timeout=T).values())
    emit("PIDS", job_pids())
    emit(
        "RESULT",
        {
            "events": [describe(e) for e in caught],
            "agent": agent,
            "later_call": later,
            "respawned": respawned,
            "early": early,
        },
    )


def run_async(library: str, main: Callable[[], Any]) -> None:
    """Run `main` as the async main task of an asyncio or trio program."""
    anyio.run(main, backend=library)


def async_caught(library: str) -> None:
    """An async main task catches a failure that happens during an unrelated await."""

    async def main() -> None:
        _, workers, pids = start()
        started = time.monotonic()
        try:
            async with supervised():
                os.kill(pids[1], signal.SIGKILL)
                await anyio.sleep(WAIT_S)
            emit("RESULT", {"interrupted": False})
            sys.exit(3)
        except SupervisionError as exc:
            caught = exc
        early = time.monotonic() - started < WAIT_S / 2
        survivor = await workers.slice(gpus=0).ping.call_one()
        async with supervised():  # handled: nothing more is raised
            await anyio.sleep(0.3)
        emit(
            "RESULT",
            {
                "event": describe(caught.event),
                "survivor": survivor,
                "type": type(caught).__name__,
                "early": early,
            },
        )

    run_async(library, main)


def async_awaited(library: str) -> None:
    """Inside a scope, the awaited call that fails raises; the failure is raised once."""

    async def main() -> None:
        _, workers, pids = start()
        raised = []
        async with supervised():
            try:
                await workers.slice(gpus=1).kill_self.call_one("SIGKILL")
            except SupervisionError as exc:
                raised.append(describe(exc.event))
            await anyio.sleep(0.5)  # a second delivery would cancel this and raise at the exit
        emit("RESULT", {"raised": raised, "pid": pids[1]})

    run_async(library, main)


def async_nested(library: str) -> None:
    """With scopes nested (and one in a concurrent task), the newest open scope gets it."""

    async def main() -> None:
        _, _, pids = start()
        caught: list[str] = []

        async def other_task(ready: anyio.Event) -> None:
            try:
                async with supervised():
                    ready.set()
                    await anyio.sleep(WAIT_S)
            except SupervisionError:
                caught.append("other")

        async with anyio.create_task_group() as group:
            try:
                async with supervised():
                    ready = anyio.Event()
                    group.start_soon(other_task, ready)
                    await ready.wait()
                    try:
                        async with supervised():  # newest: it takes the failure
                            os.kill(pids[1], signal.SIGKILL)
                            await anyio.sleep(WAIT_S)
                    except SupervisionError:
                        caught.append("inner")
                    group.cancel_scope.cancel()
                    await anyio.sleep(0.3)
            except SupervisionError:
                caught.append("outer")
        emit("RESULT", {"caught": caught})

    run_async(library, main)


def async_uncaught(library: str, scoped: str) -> None:
    """An async main that does not catch: status 1, the report, atexit, nothing left."""
    atexit.register(lambda: print("ATEXIT", flush=True))

    async def main() -> None:
        _, _, pids = start()
        os.kill(pids[1], signal.SIGKILL)
        if scoped == "scoped":
            async with supervised():
                await anyio.sleep(WAIT_S)
        else:
            await anyio.sleep(WAIT_S)
        emit("RESULT", {"interrupted": False})
        sys.exit(3)

    run_async(library, main)


SCENARIOS: dict[str, Callable[..., None]] = {
    "async_caught": async_caught,
    "async_awaited": async_awaited,
    "async_uncaught": async_uncaught,
    "async_nested": async_nested,
    "blocked_get": blocked_get,
    "interrupt": interrupt,
    "uncaught": uncaught,
    "uncaught_in_get": uncaught_in_get,
    "uncaught_actor_error": uncaught_actor_error,
    "escalated": escalated,
    "hook": hook,
    "on_failure": on_failure,
    "client_killed": client_killed,
    "agent_killed": agent_killed,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
