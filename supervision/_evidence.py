"""The evidence of a failure trimmed to fit a screen: what `SupervisionEvent.report` shows.

A traceback comes in one of two shapes. A Python traceback (an exception) matters most at its
end: the innermost frames and the error, so its end is kept. A stack dump (faulthandler's, of
a hung or crashed proc: one block per thread, the most relevant first) matters most at its
start: the first thread is kept whole, and each other thread shrinks to its innermost frame.
"""

from __future__ import annotations

import re

#: How a thread's block of a faulthandler dump starts.
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
#: At most this many other threads get a line each.
_OTHERS_SHOWN = 8
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<name>.*)$')


def trim_evidence(traceback: str, max_lines: int) -> list[str]:
    """At most `max_lines` lines of `traceback` (plus one saying what was left out)."""
    lines = traceback.rstrip().splitlines()
    if not any(_THREAD.match(line) for line in lines):
        return _keep_end(lines, max_lines)
    return _summarize_dump(lines, max_lines)


def _keep_end(lines: list[str], max_lines: int) -> list[str]:
    if len(lines) <= max_lines:
        return lines
    left_out = len(lines) - max_lines + 1
    return [lines[0], f"  ... ({left_out} lines left out)", *lines[-(max_lines - 2) :]]


def _summarize_dump(lines: list[str], max_lines: int) -> list[str]:
    """The header and first thread of a dump, and one line for each of the next threads."""
    header, threads, _ = split_stack_dump(lines)
    first, others = threads[0], threads[1:]
    shown = others[:_OTHERS_SHOWN]
    for_others = (1 + len(shown) + (len(others) > len(shown))) if others else 0
    room = max(2, max_lines - len(header) - for_others - 1)
    kept = header + first[:room]
    if len(first) > room:
        kept.append(f"  ... ({len(first) - room} outer frames left out)")
    if others:
        kept.append(f"{len(others)} other thread(s), innermost frame first:")
        kept += [_one_line(thread) for thread in shown]
        if len(others) > len(shown):
            kept.append(f"  ... and {len(others) - len(shown)} more in the event's traceback")
    return kept


def split_stack_dump(lines: list[str]) -> tuple[list[str], list[list[str]], list[str]]:
    """A faulthandler dump's lines split: the lines before the first thread, each thread's
    lines (its title, then its indented frames), and the lines after the last (e.g. Python
    3.12's "Extension modules")."""
    header: list[str] = []
    threads: list[list[str]] = []
    trailer: list[str] = []
    for line in lines:
        if _THREAD.match(line):
            threads.append([line])
        elif threads and not trailer and line[:1].isspace():
            threads[-1].append(line)
        elif threads:
            if line.strip() or trailer:
                trailer.append(line)
        else:
            header.append(line)
    return header, threads, trailer


def _one_line(thread: list[str]) -> str:
    """A thread as one line: its id and innermost frame."""
    title = _THREAD.match(thread[0])
    ident = title.group(2) if title else "?"
    frame = next((m for line in thread[1:] if (m := _FRAME.match(line))), None)
    if frame is None:
        return f"  thread {ident}: no Python frame"
    file = frame["file"].rsplit("/", 1)[-1]
    return f"  thread {ident}: {frame['name']} ({file}:{frame['line']})"
