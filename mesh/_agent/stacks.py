"""A hung or crashed proc's stack dump, ordered for reading: the most relevant thread first.

faulthandler writes one block per thread, newest thread first. What a reader wants first is
the thread that faulted (a fatal signal), else a thread running their own code (an endpoint
stuck in a call), and only then meshvisor's own threads (event loop, heartbeats) and others.
"""

from __future__ import annotations

import os
import re
import sysconfig

from supervision import split_stack_dump

_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line \d+ in ')
#: Path parts of installed packages: not your code.
_INSTALLED = ("/site-packages/", "/dist-packages/")
#: meshvisor's packages: its threads (event loop, heartbeats, workers waiting) come last.
_PACKAGES = ("transport", "supervision", "mesh", "job", "recovery", "chaos", "observe", "meshvisor")


def library_dirs() -> tuple[str, ...]:
    """The directories of code that is not the user's: the standard library and meshvisor."""
    paths = sysconfig.get_paths()
    ours = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dirs = [paths["stdlib"], paths["platstdlib"], paths["purelib"], paths["platlib"]]
    dirs += [os.path.join(ours, package) + os.sep for package in _PACKAGES]
    return tuple(dirs)


_LIBRARY_DIRS = library_dirs()


def relevant_first(dump: str, library_dirs: tuple[str, ...] | None = None) -> str:
    """`dump` (a faulthandler dump) with its threads reordered: the faulting thread of a fatal
    error first, then the threads that run code outside `library_dirs` (yours), then the
    others, each group in its original order. Any other text comes back unchanged."""
    library_dirs = library_dirs if library_dirs is not None else _LIBRARY_DIRS
    lines = dump.rstrip().splitlines()
    header, threads, trailer = split_stack_dump(lines)
    if not threads:
        return dump
    fatal = bool(header) and header[0].startswith("Fatal Python error")

    def rank(thread: list[str]) -> int:
        if fatal and thread[0].startswith("Current thread"):
            return 0
        return 1 if _runs_user_code(thread, library_dirs) else 2

    ordered = sorted(threads, key=rank)
    blocks = ["\n".join(header).rstrip()] if header else []
    blocks += ["\n".join(thread) for thread in ordered]
    blocks += ["\n".join(trailer)] if trailer else []
    return "\n\n".join(blocks) + "\n"


def _runs_user_code(thread: list[str], library_dirs: tuple[str, ...]) -> bool:
    files = (m["file"] for line in thread[1:] if (m := _FRAME.match(line)))
    return any(
        not file.startswith(library_dirs)
        and not file.startswith("<")
        and not any(part in file for part in _INSTALLED)
        for file in files
    )
