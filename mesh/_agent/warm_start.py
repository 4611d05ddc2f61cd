"""What the fork server does once so that each proc it forks starts cheaply.

A forked proc shares the fork server's memory until it writes to it, and pays for whatever it
still has to import. Two costs would otherwise come back in every proc: the modules a proc
loads on its way to ready (its runtime, the public `mesh` names its actors import, and anyio's
event-loop backend, which anyio loads at the first ``anyio.run``: about 40 ms of CPU per proc),
and the cyclic garbage collector visiting every inherited object (each visit writes to the
object's page, which the kernel then copies). So the fork server imports those modules and
freezes what it holds (`gc.freeze`): a proc's collector only walks the objects the proc made
itself. The agent itself imports none of them: it answers its clients while its fork server
warms up, and a spawn request waits in the fork server's queue until then.
"""

from __future__ import annotations

import gc
import importlib

#: Modules every proc loads before it is ready that the agent's imports leave out.
PROC_START_MODULES = ("mesh._agent.proc_main", "anyio._backends._asyncio")


def warm_up() -> None:
    """Import what each proc would import at start, then freeze what this process holds."""
    for name in PROC_START_MODULES:
        importlib.import_module(name)
    load_public_api()
    freeze_inherited()


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
