"""The life of one proc, from fork to exit: set up, say ready, serve actors until stopped."""

from __future__ import annotations

import asyncio
import base64
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Awaitable
from typing import Any

from mesh._agent.malloc_tunables import apply_malloc_tunables
from mesh._context import Context, enter_context, exit_context
from mesh._engine.census import CensusReporter
from mesh._engine.messages import Heartbeat, ProcReady, SpawnFailed
from mesh._engine.proc_faults import limit_memory, record_stacks_on_faults
from mesh._engine.runtime import Runtime
from mesh._engine.session import Session, install_session
from mesh._settings import reload_settings
from mesh._shape import Extent
from transport import (
    Outbox,
    TransportError,
    close_context,
    encode,
    follow_keys_pointer,
    get_logger,
    loads,
    new_context,
)


def start_heartbeats(runtime: Runtime, agent: str, proc_id: str, interval_s: float) -> None:
    """Tell the agent every `interval_s` that this process can still run Python code.

    A plain thread: it stops when the process is paused (SIGSTOP) or when something holds the
    GIL, which is exactly when the agent should declare the proc hung. A sync endpoint that
    sleeps or waits on I/O releases the GIL and is not mistaken for a hang.
    """
    beat = encode(Heartbeat(proc_id))
    census = CensusReporter(proc_id, runtime.host.hosted)

    def loop() -> None:
        while True:
            try:
                runtime.outbox.send(agent, beat)
                if (changed := census.changed()) is not None:  # for the live view
                    runtime.outbox.send(agent, encode(changed))
            except TransportError:
                return
            if runtime.closed.wait(interval_s):
                return

    threading.Thread(target=loop, name="meshvisor-heartbeat", daemon=True).start()


def report_start_failure(config: dict[str, Any], reason: str) -> None:
    """Tell the agent why this proc could not start, before exiting: its exit report then
    carries the reason (otherwise only in this proc's stderr)."""
    context = new_context()
    outbox = Outbox(context)
    try:
        outbox.send(config["agent"], encode(SpawnFailed(config["proc_id"], "", reason)))
    except TransportError:
        pass
    outbox.close(linger_ms=2000)
    close_context(context)


def run_setup(setup: str, where: Context) -> str | None:
    """Run the proc mesh's bootstrap function (``spawn_procs(bootstrap=...)``, pickled and
    base64-encoded in `setup`; an async one to its end) as `where` (`current_rank()` is the
    proc's point); why it failed, or None."""
    if not setup:
        return None
    name = "the bootstrap function"
    token = enter_context(where)
    try:
        function = loads(base64.b64decode(setup))
        name = f"the bootstrap function {getattr(function, '__qualname__', repr(function))}"
        result = function()
        if inspect.isawaitable(result):
            asyncio.run(_wait_for(result))
    except BaseException as error:
        trace = "".join(traceback.format_exception(error)).rstrip()
        return f"{name} raised {type(error).__name__}: {error}\n{trace}"
    finally:
        exit_context(token)
    return None


def _proc_context(config: dict[str, Any], host: str) -> Context:
    """The context of a proc outside its actors: its mesh and point."""
    point = Extent(tuple(config["labels"]), tuple(config["sizes"])).point(config["rank"])
    return Context(None, config["mesh_name"], point, config["proc_id"], host, os.getpid())


async def _wait_for(awaitable: Awaitable[object]) -> None:
    await awaitable


def run_proc(config: dict[str, Any]) -> int:
    """Run a proc described by `config` (built by the host agent); returns the exit code."""
    os.environ.update(config["env"])
    malloc_problems = apply_malloc_tunables(os.environ.get("GLIBC_TUNABLES", ""))
    sys.path[:] = list(config["sys_path"])
    os.chdir(config["cwd"])
    reload_settings()  # those of its own environment, not the fork server's
    follow_keys_pointer(config["rundir"])  # its owner's, if it attaches to tcp agents later
    record_stacks_on_faults(config["rundir"], config["proc_id"])
    limit_memory(config["memory_limit"], config["rundir"], config["proc_id"])
    try:
        runtime = Runtime(config["address"], proc_id=config["proc_id"], agent=config["agent"])
    except TransportError as error:  # e.g. no space left for its socket file
        report_start_failure(config, f"the proc could not start: {error}")
        return 1
    session = Session(
        runtime,
        rundir=config["rundir"],
        agent=config["agent"],
        proc=(config["mesh_name"], tuple(config["labels"]), tuple(config["sizes"]), config["rank"]),
    )
    install_session(session)
    log = get_logger("mesh.proc", proc=config["proc_id"])
    if malloc_problems:
        log.warning("malloc_tunables_not_applied", problems=malloc_problems)
    start_heartbeats(runtime, config["agent"], config["proc_id"], config["heartbeat_interval_s"])
    runtime.paused_calls.install()  # breakpoint() pauses the call for `meshvisor debug`
    failure = run_setup(config["setup"], _proc_context(config, runtime.hostname))
    if failure is not None:
        session.close()
        report_start_failure(config, failure)
        return 1
    ready = ProcReady(config["proc_id"], runtime.address, os.getpid(), runtime.hostname)
    runtime.send_message(config["owner"], ready)
    runtime.send_message(config["agent"], ready)  # a tcp proc's port is news to the agent too
    log.info("proc_started", mesh=config["mesh_name"], rank=config["rank"])
    runtime.receive_on_workers()  # sync calls run on the thread that receives them
    try:
        runtime.run()
    finally:
        session.close()
    log.info("proc_exiting")
    return 0
