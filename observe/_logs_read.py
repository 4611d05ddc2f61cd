"""Reading the per-rank log files of a run (`mesh._agent.log_files`): the records of every
file, filtered, merged across ranks in time order; and following them as they grow.

A proc's records are in time order within its files (oldest ``X.log.N`` ... ``X.log``), so the
merge of all procs is a heap merge that never holds more than one record per proc.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from mesh.tooling import LEVELS, level_at_least

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
Record = dict[str, Any]
#: How far files were read, by (device, inode).
Offsets = dict[tuple[int, int], int]
_DIGITS = re.compile(r"[0-9]+")
_ROTATED = re.compile(r"^(?P<proc>.+)\.log(?:\.(?P<index>\d+))?$")


class LogsError(Exception):
    """A request the logs cannot answer: no such run, job, mesh, or a bad filter."""


@dataclass(frozen=True)
class LogFilter:
    """Which records to show: of `mesh`, of `ranks` (flat ranks or coordinates, any of them),
    at `level` or above, from `since` to `until` (seconds since the epoch); None: any."""

    mesh: str | None = None
    ranks: tuple[int | dict[str, int], ...] = ()
    level: str | None = None
    since: float | None = None
    until: float | None = None

    @classmethod
    def from_options(
        cls,
        mesh: str | None = None,
        ranks: Iterable[str] = (),
        level: str | None = None,
        since: str | None = None,
        until: str | None = None,
    ) -> LogFilter:
        """The filter ``meshvisor logs`` options ask for (see `parse_rank`, `parse_time`);
        LogsError naming the option that is wrong."""
        if level is not None and level.lower() not in LEVELS:
            raise LogsError(f"--level {level!r} is not a level; use one of {', '.join(LEVELS)}")
        return cls(
            mesh,
            tuple(parse_rank(text) for text in ranks),
            level.lower() if level else None,
            parse_time("--since", since),
            parse_time("--until", until),
        )

    def keeps_proc(self, first: Record) -> bool:
        """Whether the proc whose first record is `first` can have records to show."""
        if self.mesh is not None and first.get("mesh") != self.mesh:
            return False
        return not self.ranks or any(_rank_matches(first, rank) for rank in self.ranks)

    def keeps(self, record: Record) -> bool:
        if not self.keeps_proc(record):
            return False
        if self.level is not None and not level_at_least(str(record.get("level")), self.level):
            return False
        time_s = record.get("t", 0.0)
        if self.since is not None and time_s < self.since:
            return False
        return self.until is None or time_s <= self.until


def parse_rank(text: str) -> int | dict[str, int]:
    """``3`` → 3; ``hosts=0,gpus=1`` → {"hosts": 0, "gpus": 1}; LogsError otherwise."""
    text = text.strip()
    if _DIGITS.fullmatch(text):
        return int(text)
    coords = {}
    for part in text.split(","):
        label, _, index = part.partition("=")
        if not label.strip() or not _DIGITS.fullmatch(index.strip()):
            raise LogsError(
                f"--rank {text!r} is not a rank: give a flat rank (3) or coordinates "
                "(hosts=0,gpus=1)"
            )
        coords[label.strip()] = int(index)
    return coords


def parse_time(option: str, text: str | None, now: float | None = None) -> float | None:
    """`text` as seconds since the epoch: a duration ago (``10m``) or a time (ISO 8601, local
    time unless it says otherwise); LogsError naming `option` otherwise."""
    if text is None:
        return None
    text = text.strip()
    unit = _UNITS.get(text[-1:].lower())
    try:
        if unit is not None:
            ago = float(text[:-1]) * unit
            if not (math.isfinite(ago) and ago >= 0):
                raise ValueError
            return (time.time() if now is None else now) - ago
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise LogsError(
            f"{option} {text!r} is neither a duration (30s, 10m, 2h, 1d) nor a time "
            "(2026-05-01T10:00:00)"
        ) from None


def _rank_matches(record: Record, rank: int | dict[str, int]) -> bool:
    if isinstance(rank, int):
        return bool(record.get("rank") == rank)
    point = record.get("point") or {}
    return all(point.get(label) == index for label, index in rank.items())


def proc_files(directory: Path) -> dict[str, list[Path]]:
    """Each proc's log files in `directory`, oldest first."""
    found: dict[str, list[tuple[int, Path]]] = {}
    for path in directory.iterdir():
        match = _ROTATED.match(path.name)
        if match is not None and path.is_file():
            index = int(match.group("index") or 0)
            found.setdefault(match.group("proc"), []).append((-index, path))
    return {proc: [path for _, path in sorted(files)] for proc, files in found.items()}


def parse_records(data: bytes) -> Iterator[Record]:
    """The records in `data` (complete lines); lines that are not records are skipped."""
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("t"), (int, float)):
            yield record


def first_record(files: list[Path]) -> Record | None:
    """The first record of a proc's files (its mesh, rank and point), None if none yet."""
    for path in files:
        try:
            with open(path, "rb") as handle:
                for record in parse_records(handle.readline()):
                    return record
        except OSError:
            continue
    return None


def _records_of(files: list[Path], keep: LogFilter, offsets: Offsets) -> Iterator[Record]:
    """The records of one proc's `files` that `keep` keeps; how far each file was read goes
    into `offsets`."""
    for path in files:
        try:
            with open(path, "rb") as handle:
                status = os.fstat(handle.fileno())
                data = handle.read()
        except OSError:  # rotated away meanwhile
            continue
        data = data[: data.rfind(b"\n") + 1]  # a line being written is not complete yet
        offsets[(status.st_dev, status.st_ino)] = len(data)
        yield from (record for record in parse_records(data) if keep.keeps(record))


def read_logs(directory: str | os.PathLike[str], keep: LogFilter | None = None) -> Iterator[Record]:
    """The records of the log directory `directory` (see docs/logs.md) that `keep` keeps, all
    ranks merged in time order, as dicts (``t``, ``mesh``, ``rank``, ``point``, ``proc``,
    ``pid``, ``host``, ``stream``, ``level``, ``text``)."""
    path = Path(directory)
    if not path.is_dir():
        raise LogsError(f"log directory {path} not found")
    return merged_records(path, keep or LogFilter(), {})[0]


def merged_records(
    directory: Path, keep: LogFilter, offsets: Offsets
) -> tuple[Iterator[Record], set[str]]:
    """The records of `directory` that `keep` keeps, in time order across procs (how far each
    file was read goes into `offsets`, for a `Follower`); and the meshes that wrote there (to
    explain a filter that matches nothing)."""
    streams = []
    meshes = set()
    for files in proc_files(directory).values():
        first = first_record(files)
        if first is None:
            continue
        meshes.add(str(first.get("mesh")))
        if keep.keeps_proc(first):
            streams.append(_records_of(files, keep, offsets))
    return heapq.merge(*streams, key=lambda record: float(record["t"])), meshes


class Follower:
    """New records of `directory` since the last look: the files are read from where they
    were left (by inode, so a rotated file is finished before its successor is read)."""

    def __init__(self, directory: Path, keep: LogFilter, offsets: Offsets) -> None:
        self._directory = directory
        self._keep = keep
        self._offsets = dict(offsets)

    def new_records(self) -> list[Record]:
        """The records written since the last call, those `keep` keeps, in time order."""
        found: list[Record] = []
        seen: Offsets = {}
        for path, key, size in self._files():
            offset = self._offsets.get(key, 0)
            if size < offset:  # a new file that reuses the inode of a removed one
                offset = 0
            data = _read_range(path, offset, size)
            seen[key] = offset + len(data)
            found.extend(record for record in parse_records(data) if self._keep.keeps(record))
        self._offsets = seen
        return sorted(found, key=lambda record: float(record["t"]))

    def _files(self) -> Iterable[tuple[Path, tuple[int, int], int]]:
        for files in proc_files(self._directory).values():
            for path in files:
                try:
                    status = path.stat()
                except OSError:
                    continue
                yield path, (status.st_dev, status.st_ino), status.st_size


def _read_range(path: Path, start: int, end: int) -> bytes:
    """The complete lines of `path` between `start` and `end`."""
    if end <= start:
        return b""
    try:
        with open(path, "rb") as handle:
            handle.seek(start)
            data = handle.read(end - start)
    except OSError:
        return b""
    return data[: data.rfind(b"\n") + 1]


def shown(record: Record, with_time: bool) -> str:
    """A record as the client shows its line: ``[trainers {'gpus': 1}] text``."""
    line = f"[{record.get('mesh')} {record.get('point')}] {record.get('text')}"
    if not with_time:
        return line
    from datetime import datetime

    stamp = datetime.fromtimestamp(float(record["t"])).isoformat(timespec="milliseconds")
    return f"{stamp} {record.get('level', 'info'):<8} {line}"


def as_json(record: Record) -> str:
    return json.dumps(record, separators=(",", ":"))
