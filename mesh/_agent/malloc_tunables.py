"""glibc's ``malloc`` tunables in a forked proc.

glibc reads ``GLIBC_TUNABLES`` once, when a program starts. A proc is forked from its fork
server, which started long before, so the variable in the proc's own environment (its
spawn's ``env``) would be ignored. Its ``glibc.malloc.*`` entries that ``mallopt`` can set are
applied here instead, before the proc starts its first thread (a thread's arena is chosen at
its first allocation, so ``arena_max`` only holds for threads started after it).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

#: The ``mallopt`` parameter of each tunable (malloc.h's ``M_*`` values).
MALLOPT_PARAMETERS = {
    "glibc.malloc.trim_threshold": -1,
    "glibc.malloc.top_pad": -2,
    "glibc.malloc.mmap_threshold": -3,
    "glibc.malloc.mmap_max": -4,
    "glibc.malloc.arena_test": -7,
    "glibc.malloc.arena_max": -8,
}
_INT_MAX = 2**31 - 1  # mallopt takes a C int: larger sizes mean "as large as it gets"


def apply_malloc_tunables(tunables: str) -> list[str]:
    """Apply the ``glibc.malloc.*`` entries of `tunables` (``GLIBC_TUNABLES`` syntax: ``name=
    value`` pairs joined by ``:``) with ``mallopt``; returns those it could not apply, with
    why. Other tunables are left alone: glibc applied them, or they cannot change now."""
    entries = [e.partition("=") for e in tunables.split(":") if e.startswith("glibc.malloc.")]
    if not entries:
        return []
    mallopt = _mallopt()
    if mallopt is None:
        return [f"{name}: this C library has no mallopt" for name, _, _ in entries]
    problems = []
    for name, _, value in entries:
        parameter = MALLOPT_PARAMETERS.get(name)
        if parameter is None:
            problems.append(f"{name}: only {', '.join(MALLOPT_PARAMETERS)} apply in a forked proc")
        elif not value.isdigit():
            problems.append(f"{name}={value}: the value must be a whole number")
        elif not mallopt(parameter, min(int(value), _INT_MAX)):
            problems.append(f"{name}={value}: mallopt refused it")
    return problems


def _mallopt() -> Callable[[int, int], int] | None:
    """The C library's ``mallopt(int, int) -> int`` (from this process's own symbols), or
    None where it has none."""
    try:
        function = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return function  # type: ignore[no-any-return]
