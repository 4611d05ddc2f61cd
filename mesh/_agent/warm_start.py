"""What the fork server does once so that each proc it forks starts cheaply.

A forked proc shares the fork server's memory until it writes to it, and pays for whatever it
still has to import. Two costs would otherwise come back in every proc: the modules a proc
loads on its way to ready (its runtime, the public `mesh` names its actors import, and anyio's
event-loop backend, which anyio loads at the first ``anyio.run``: about 40 ms of CPU per proc),
and the cyclic garbage collector visiting every inherited object (each visit writes to the
object's page, which the kernel then copies). So the fork server imports those modules and
freezes what it holds (`gc.freeze`): a proc's collector only walks the objects the proc made
itself. The agent itself imports none of them: it answers its clients while its fork server
warms up.

The warm-up comes in two parts. What every proc runs on (`warm_up_runtime`) is imported
before the fork server serves anything. The rest (`WarmUp`: the client API an actor module
may import, then the freeze) goes step by step while no request waits: a request for one proc
(a client's first spawn, often) is served between two steps, so that proc does not wait for
modules its actor may not need (it imports those it does need itself); a request for many
procs first finishes the warm-up, which they all share.
"""

from __future__ import annotations

import functools
import gc
import importlib
from collections.abc import Callable, Iterator

#: Modules every proc loads before it is ready that the agent's imports leave out.
PROC_START_MODULES = ("mesh._agent.proc_main", "anyio._backends._asyncio")
#: Modules the agent and its procs both run on, beyond what it takes to fork the fork server.
#: The agent imports them before that fork, and its own modules (`host_agent` and what only
#: it needs) after it, while the fork server imports the procs' runtime: so neither imports a
#: module twice, and the agent's own imports are no longer on a first proc's way to ready.
SHARED_MODULES = (
    "supervision",
    "mesh._engine.host_services",
    "mesh._engine.fanout_messages",
    "mesh._engine.payload_arena",
    "mesh._engine.fault_rules",
    "mesh._engine.proc_faults",
    "mesh._engine.workspace_files",
    "mesh._engine.debug_messages",
    "mesh._engine.view_messages",
)


def import_shared() -> None:
    """Import what the agent and its procs both run on (`SHARED_MODULES`)."""
    for name in SHARED_MODULES:
        importlib.import_module(name)


def warm_up() -> None:
    """Import what each proc would import at start, then freeze what this process holds."""
    warm_up_runtime()
    WarmUp().finish()


def warm_up_runtime() -> None:
    """Import what every proc runs on, whatever its actors."""
    for name in PROC_START_MODULES:
        importlib.import_module(name)


class WarmUp:
    """The rest of the warm-up, in steps short enough to serve a waiting request between two:
    each module of the public API, then the public names themselves, then the freeze."""

    def __init__(self) -> None:
        self._steps = _later_steps()
        self.done = False

    def step(self) -> None:
        """Take the next step (the fork server does when no request waits)."""
        step = next(self._steps, None)
        if step is None:
            self.done = True
        else:
            step()

    def finish(self) -> None:
        """Take every step left (before a request for many procs: they all share it)."""
        for step in self._steps:
            step()
        self.done = True


def _later_steps() -> Iterator[Callable[[], None]]:
    package = importlib.import_module("mesh")
    for home in sorted(set(package._HOMES.values())):
        yield functools.partial(_import, home)
    yield load_public_api
    yield freeze_inherited


def _import(name: str) -> None:
    importlib.import_module(name)


def load_public_api() -> None:
    """Load every public name of `mesh` (loaded at first use), as an actor's module does with
    ``from mesh import Actor``: each proc would otherwise load the client API itself."""
    package = importlib.import_module("mesh")
    for name in package.__all__:
        getattr(package, name)


def freeze_inherited() -> None:
    """Keep the objects alive now out of the collector's walks in this process and its future
    forks (after an import, before forking): their pages stay shared with the procs."""
    gc.freeze()
