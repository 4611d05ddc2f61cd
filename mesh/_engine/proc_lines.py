"""Proc lines with their source, and their aggregation: identical lines of many ranks within
one window are shown once, with how many ranks (and which) printed them.

Similar lines, those that differ only in their numbers (``loss 0.1234`` and ``loss 0.1251``),
are aggregated too unless the mesh asked for identical lines only: they are shown once with
each number that differs written as the values it took, ``loss {0.1234..0.1251}`` (``{0,3}``
for up to `_LISTED` values), so that what is shown was printed. A training loop's ranks print
such lines; their every line is in the per-rank log files.
"""

from __future__ import annotations

import re
from typing import NamedTuple

#: A rank as its coordinates, e.g. (("gpus", 2),).
Coords = tuple[tuple[str, int], ...]
#: A number in a line: digits, with a fraction and an exponent (a sign is text).
_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
#: Distinct values of a number listed as such; more are shown as their range.
_LISTED = 4


class RankedLine(NamedTuple):
    """One line a proc printed: its `stream` (1 stdout, 2 stderr), `text`, `source` (the mesh
    and point, as the agent names it) and the rank's coordinates. A named tuple: a chatty mesh
    makes hundreds of thousands a second, and a frozen dataclass costs several times more."""

    stream: int
    text: str
    source: str
    rank: Coords

    def shown_alone(self) -> str:
        return f"[{self.source}] {self.text}"


class Aggregator:
    """The lines of one mesh within one window, each distinct (stream, text) once, in the order
    first seen, with the ranks that printed it and how many times; with `similar`, lines that
    differ only in their numbers count as one."""

    def __init__(self, similar: bool = False) -> None:
        self._similar = similar
        self._lines: dict[tuple[int, str], list[RankedLine]] = {}

    def add(self, line: RankedLine) -> None:
        text = _NUMBER.sub("#", line.text) if self._similar else line.text
        self._lines.setdefault((line.stream, text), []).append(line)

    def take(self) -> list[tuple[int, str]]:
        """(stream, shown line) for each distinct line, and forget them."""
        shown = [(stream, _show(lines)) for (stream, _), lines in self._lines.items()]
        self._lines.clear()
        return shown


def _show(lines: list[RankedLine]) -> str:
    """``[trainers {'gpus': 1}] text`` for one line, ``[4 ranks: trainers{gpus=0..3}] text``
    for one from four ranks (``, 8 times`` when ranks repeated it)."""
    ranks = list(dict.fromkeys(line.rank for line in lines))
    if len(lines) == 1:
        return lines[0].shown_alone()
    mesh = lines[0].source.split(" ", 1)[0]
    times = f", {len(lines)} times" if len(lines) > len(ranks) else ""
    noun = "rank" if len(ranks) == 1 else "ranks"
    text = merged_text([line.text for line in lines])
    return f"[{len(ranks)} {noun}{times}: {mesh}{{{describe_ranks(ranks)}}}] {text}"


def merged_text(texts: list[str]) -> str:
    """One text for `texts`, which differ at most in their numbers: each number that differs
    shown as the values it took (``{0.12..0.19}``, or ``{1,3}`` for a few)."""
    first = texts[0]
    if all(text == first for text in texts):
        return first
    pieces = _NUMBER.split(first)
    columns = zip(*(_NUMBER.findall(text) for text in texts))
    shown = [pieces[0]]
    for values, after in zip(columns, pieces[1:]):
        shown.append(_values(list(values)) + after)
    return "".join(shown)


def _values(values: list[str]) -> str:
    """A number's values: itself when they agree, else ``{a,b}`` or ``{min..max}``."""
    distinct = sorted(set(values), key=float)
    if len(distinct) == 1:
        return distinct[0]
    if len(distinct) <= _LISTED:
        return "{" + ",".join(distinct) + "}"
    return f"{{{distinct[0]}..{distinct[-1]}}}"


def describe_ranks(ranks: list[Coords]) -> str:
    """The coordinates each dimension takes among `ranks`, as runs: ``gpus=0..3`` or
    ``hosts=0, gpus=0..1,3``."""
    if not ranks or not ranks[0]:
        return ""
    labels = [label for label, _ in ranks[0]]
    parts = []
    for index, label in enumerate(labels):
        values = sorted({rank[index][1] for rank in ranks})
        parts.append(f"{label}={_runs(values)}")
    return ", ".join(parts)


def _runs(values: list[int]) -> str:
    """Sorted distinct `values` as runs: [0, 1, 2, 3, 5] -> ``0..3,5``."""
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ",".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)
