"""The hand-written validator of a chaos report's JSON form (schema ``meshvisor.chaos/1``, see
``docs/chaos-report.md``): each field is checked by a small function of (value, path), so that
an error names the path of the first bad field."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, NoReturn

from ._faults import FAULT_KINDS
from ._model import VERDICTS
from ._percentiles import PERCENTILE_KEYS
from ._targets import TARGET_LEVELS

#: The value of the ``"schema"`` key of every report chaos writes and reads.
SCHEMA = "meshvisor.chaos/1"

_Check = Callable[[Any, str], None]
_short_repr = reprlib.Repr()
_short_repr.maxstring = 60
_short_repr.maxother = 60


def _fail(path: str, message: str) -> NoReturn:
    raise ValueError(f"{path or '<report>'}: {message}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _shown(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object"
    return f"{names.get(type(value), type(value).__name__)} {_short_repr.repr(value)}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _string(value: Any, path: str) -> None:
    if not isinstance(value, str):
        _fail(path, f"expected a string, got {_shown(value)}")


def _boolean(value: Any, path: str) -> None:
    if not isinstance(value, bool):
        _fail(path, f"expected a boolean, got {_shown(value)}")


def _integer(value: Any, path: str) -> None:
    if not _is_int(value):
        _fail(path, f"expected an integer, got {_shown(value)}")


def _count(value: Any, path: str) -> None:
    _integer(value, path)
    if value < 0:
        _fail(path, f"expected a count (>= 0), got {value!r}")


def _number(value: Any, path: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        _fail(path, f"expected a number, got {_shown(value)}")
    if not math.isfinite(value):
        _fail(path, f"expected a finite number, got {value!r}")


def _non_negative(value: Any, path: str) -> None:
    _number(value, path)
    if value < 0:
        _fail(path, f"expected a number >= 0, got {value!r}")


def _fraction(value: Any, path: str) -> None:
    _number(value, path)
    if not 0 <= value <= 1:
        _fail(path, f"expected a number within [0, 1], got {value!r}")


def _any_object(value: Any, path: str) -> None:
    if not isinstance(value, dict):
        _fail(path, f"expected an object, got {_shown(value)}")
    for key in value:
        if not isinstance(key, str):
            _fail(path, f"object keys must be strings, got {_shown(key)}")


def _optional(check: _Check) -> _Check:
    def checked(value: Any, path: str) -> None:
        if value is not None:
            check(value, path)

    return checked


def _one_of(choices: Sequence[str]) -> _Check:
    def checked(value: Any, path: str) -> None:
        if value not in choices or not isinstance(value, str):
            shown = ", ".join(repr(c) for c in choices)
            _fail(path, f"{_short_repr.repr(value)} is not one of {shown}")

    return checked


def _list_of(check: _Check) -> _Check:
    def checked(value: Any, path: str) -> None:
        if not isinstance(value, list):
            _fail(path, f"expected an array, got {_shown(value)}")
        for i, item in enumerate(value):
            check(item, f"{path}[{i}]")

    return checked


def _object(fields: dict[str, _Check], optional: dict[str, _Check] | None = None) -> _Check:
    """An object with exactly the keys of `fields` (and maybe those of `optional`), each
    passing its check."""
    optional = optional or {}

    def checked(value: Any, path: str) -> None:
        _any_object(value, path)
        for key, check in fields.items():
            if key not in value:
                _fail(_join(path, key), "required key is missing")
            check(value[key], _join(path, key))
        for key in value:
            if key in optional:
                optional[key](value[key], _join(path, key))
            elif key not in fields:
                _fail(_join(path, key), "unexpected key")

    return checked


def _timestamp(value: Any, path: str) -> None:
    _string(value, path)
    text = value[:-1] + "+00:00" if value.endswith(("Z", "z")) else value
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        _fail(path, f"{_short_repr.repr(value)} is not an ISO 8601 timestamp")
    if when.utcoffset() != timedelta(0):
        _fail(path, f"{_short_repr.repr(value)} is not in UTC (expected a +00:00 or Z offset)")


def _percentile_summary(value: Any, path: str) -> None:
    _object({"count": _count, **{k: _optional(_number) for k in PERCENTILE_KEYS[1:]}})(value, path)
    for key in PERCENTILE_KEYS[1:]:
        if (value[key] is None) != (value["count"] == 0):
            state = "null" if value[key] is None else "set"
            _fail(_join(path, key), f"is {state} but count is {value['count']}")


_target = _object(
    {
        "level": _one_of(TARGET_LEVELS),
        "mesh": _optional(_string),
        "rank": _optional(_count),
        "host": _optional(_count),
    }
)
_fault = _object(
    {
        "kind": _one_of(FAULT_KINDS),
        "signal": _optional(_string),
        "exit_code": _optional(_integer),
        "duration_s": _non_negative,
        "probability": _fraction,
        "delay_ms": _non_negative,
        "endpoint": _optional(_string),
        "fatal": _boolean,
    }
)
_fault_record = _object(
    {
        "index": _count,
        "at_s": _number,
        "fault": _fault,
        "description": _string,
        "target": _target,
        "target_description": _string,
        "expected_events": _list_of(_string),
        "observed_events": _list_of(_string),
        "injected_at_s": _optional(_number),
        "detected_at_s": _optional(_number),
        "healthy_at_s": _optional(_number),
        "detect_s": _optional(_number),
        "recover_s": _optional(_number),
        "verdict": _one_of(VERDICTS),
        "note": _string,
    }
)
_event = _object(
    {
        "at_s": _number,
        "kind": _string,
        "mesh": _optional(_string),
        "rank": _optional(_count),
        "host": _optional(_count),
        "pid": _optional(_integer),
        "message": _string,
        "fault": _optional(_count),
    },
    optional={"evidence": _string},
)
_timings = _object({"detect_s": _percentile_summary, "recover_s": _percentile_summary})
_kind_summary = _object(
    {"count": _count, "detect_s": _percentile_summary, "recover_s": _percentile_summary}
)
_invariant = _object({"name": _string, "held": _boolean, "detail": _string, "builtin": _boolean})


def _by_kind(value: Any, path: str) -> None:
    _any_object(value, path)
    for kind, summary in value.items():
        if kind not in FAULT_KINDS:
            _fail(
                f"{path}.{kind}", f"{kind!r} is not a fault kind; known: {', '.join(FAULT_KINDS)}"
            )
        _kind_summary(summary, f"{path}.{kind}")


def _schema(value: Any, path: str) -> None:
    if value != SCHEMA:
        _fail(path, f"{_short_repr.repr(value)} is not the supported schema {SCHEMA!r}")


_report = _object(
    {
        "schema": _schema,
        "ok": _boolean,
        "seed": _optional(_integer),
        "replay": _string,
        "workload": _string,
        "started_at": _timestamp,
        "wall_s": _non_negative,
        "schedule": _any_object,
        "targets": _any_object,
        "faults": _list_of(_fault_record),
        "events": _list_of(_event),
        "percentiles": _timings,
        "by_kind": _by_kind,
        "invariants": _list_of(_invariant),
        "workload_stats": _any_object,
    }
)


def validate_report(data: dict[str, Any]) -> None:
    """Check a loaded JSON report against the ``meshvisor.chaos/1`` schema.

    Checks the schema string, that every key is present (and no unknown key is), the type of
    every field, the verdicts, the fault kinds and target levels, that fault indices are unique,
    that each event's ``fault`` names a fault of the report, and that ``ok`` agrees with the
    invariants. Raises ValueError whose message starts with the path of the first bad field,
    e.g. ``faults[3].verdict: 'maybe' is not one of 'ok', ...``.
    """
    if isinstance(data, dict) and "schema" in data:
        _schema(data["schema"], "schema")  # a report of another schema: say so first
    _report(data, "")
    seen: dict[int, int] = {}
    for i, record in enumerate(data["faults"]):
        if record["index"] in seen:
            _fail(
                f"faults[{i}].index",
                f"{record['index']} repeats the index of faults[{seen[record['index']]}]",
            )
        seen[record["index"]] = i
    for i, event in enumerate(data["events"]):
        if event["fault"] is not None and event["fault"] not in seen:
            _fail(f"events[{i}].fault", f"{event['fault']} is not the index of any fault")
    invariants = data["invariants"]
    ok = bool(invariants) and all(inv["held"] for inv in invariants)
    if data["ok"] != ok:
        why = "no invariant was checked" if not invariants else "of the invariants' results"
        _fail("ok", f"is {data['ok']!r} but must be {ok!r} because {why}")
