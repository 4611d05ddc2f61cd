"""What the fork server does once so that each proc it forks starts cheaply.

A forked proc shares the fork server's memory until it writes to it, and pays for whatever it
still has to import. Two costs would otherwise come back in every proc: the modules a proc
loads on its way to ready that no import made yet (anyio loads its event-loop backend at the
first ``anyio.run``: about 40 ms of CPU per proc), and the cyclic garbage collector visiting
every inherited object (each visit writes to the object's page, which the kernel then copies).
So the fork server imports those modules and freezes what it holds (`gc.freeze`): a proc's
collector only walks the objects the proc made itself.
"""

from __future__ import annotations

import gc
import importlib

#: Modules every proc loads before it is ready that the agent's imports leave out.
PROC_START_MODULES = ("anyio._backends._asyncio",)


def warm_up() -> None:
    """Import what each proc would import at start, then freeze what this process holds."""
    for name in PROC_START_MODULES:
        importlib.import_module(name)
    freeze_inherited()


def freeze_inherited() -> None:
    """Keep the objects alive now out of the collector's walks in this process and its future
    forks (after an import, before forking): their pages stay shared with the procs."""
    gc.freeze()
