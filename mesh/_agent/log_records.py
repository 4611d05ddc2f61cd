"""The records of the per-rank log files: one JSON object per line a proc printed.

Each record is self-contained, so that a file can be filtered with any tool: ``t`` (seconds
since the epoch when the fork server read the line), ``mesh``, ``rank`` (the flat rank in the
proc mesh), ``point`` (its coordinates), ``proc`` (proc id), ``pid``, ``host``, ``stream``
(``stdout`` or ``stderr``), ``level`` and ``text``.

The level of a line: that of a log record when the line reads like one (`line_level`), else
``info`` on stdout and ``error`` on stderr (where Python writes tracebacks and warnings).
"""

from __future__ import annotations

import json
import re
from typing import Any

from mesh._shape import Extent

#: Level names, from the least to the most severe.
LEVELS = ("debug", "info", "warning", "error", "critical")
STREAMS = {1: "stdout", 2: "stderr"}
#: The level of a print line that names none, by stream.
_STREAM_LEVELS = {1: "info", 2: "error"}
_ALIASES = {"warn": "warning", "fatal": "critical", "exception": "error"}
_NAMES = "debug|info|warning|warn|error|critical|fatal|exception"
#: A log record's level at the start of a line, after an optional time stamp: ``WARNING:root:``
#: (logging's default format), ``2024-05-01 10:00:00,123 ERROR name``, structlog's console
#: ``2024-05-01T10:00:00Z [info     ] event``. Upper case alone, or any case in brackets.
_LEADING_LEVEL = re.compile(
    rf"[\d\s\-:.,/TZ+]*(?:\[\s*(?P<bracketed>(?i:{_NAMES}))\s*\]|(?P<upper>{_NAMES.upper()})\b)"
)
#: A JSON log record (structlog's JSONRenderer, most JSON formatters): its "level" field.
_JSON_LEVEL = re.compile(r'"(?:level|levelname|severity)"\s*:\s*"(\w+)"')
_encode_string = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]


def line_level(text: str, stream: int) -> str:
    """The level of the line `text` printed on `stream` (1 stdout, 2 stderr)."""
    match = _LEADING_LEVEL.match(text)
    if match is not None:
        name = (match.group("bracketed") or match.group("upper")).lower()
        return _ALIASES.get(name, name)
    if text.startswith("{") and (found := _JSON_LEVEL.search(text)) is not None:
        name = found.group(1).lower()
        name = _ALIASES.get(name, name)
        if name in LEVELS:
            return name
    return _STREAM_LEVELS.get(stream, "info")


def level_at_least(level: str, least: str) -> bool:
    """Whether `level` is `least` or more severe (an unknown level counts as info)."""
    rank = LEVELS.index(level) if level in LEVELS else 1
    return rank >= LEVELS.index(least)


class RecordEncoder:
    """Encodes the lines of one proc as records; what never changes is encoded once."""

    def __init__(self, config: dict[str, Any], pid: int, host: str) -> None:
        extent = Extent(tuple(config["labels"]), tuple(config["sizes"]))
        point = dict(extent.point(config["rank"]))
        constant = {
            "mesh": config["mesh_name"],
            "rank": config["rank"],
            "point": point,
            "proc": config["proc_id"],
            "pid": pid,
            "host": host,
        }
        self._middle = json.dumps(constant, separators=(",", ":"))[1:-1]

    def encode(self, time_s: float, stream: int, texts: list[str]) -> bytes:
        """The records of `texts`, printed on `stream` and read at `time_s`."""
        head = f'{{"t":{time_s:.6f},{self._middle},"stream":"{STREAMS.get(stream, "stdout")}"'
        return "".join(
            f'{head},"level":"{line_level(text, stream)}","text":{_encode_string(text)}}}\n'
            for text in texts
        ).encode()
