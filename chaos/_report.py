"""The report of a chaos run: its JSON form (schema ``meshvisor.chaos/1``, see
``docs/chaos-report.md``), a hand-written validator for it, and a human view rendered with rich."""

from __future__ import annotations

import io
import json
import math
import os
import reprlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._model import (
    FAULT_KINDS,
    Fault,
    FaultRecord,
    InvariantResult,
    ObservedEvent,
    PlannedFault,
    Target,
    Verdict,
)

__all__ = [
    "SCHEMA",
    "VERDICTS",
    "RunReport",
    "percentiles",
    "render",
    "render_text",
    "validate_report",
]

#: The value of the ``"schema"`` key of every report this module writes and reads.
SCHEMA = "meshvisor.chaos/1"
#: Every verdict a fault record can have.
VERDICTS: tuple[Verdict, ...] = ("ok", "missed", "wrong_kind", "not_healed", "not_injected")
#: The percentiles reported, as (key, percent).
_PERCENTS: tuple[tuple[str, int], ...] = (("p50", 50), ("p90", 90), ("p99", 99))
_PERCENTILE_KEYS: tuple[str, ...] = ("count", "p50", "p90", "p99", "max", "mean")


def percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    """Summarise `values`: ``count``, ``p50``, ``p90``, ``p99``, ``max`` and ``mean``.

    Percentiles use the nearest-rank method: the p-th percentile of n sorted values is the
    value at (1-based) rank ``ceil(p * n / 100)``, i.e. the smallest value such that at least
    p % of the values are less than or equal to it. It is always one of the values (never an
    interpolation). For an empty input ``count`` is 0 and every other key is None.
    """
    ordered = sorted(float(v) for v in values)
    n = len(ordered)
    result: dict[str, float | int | None] = {"count": n}
    for key, percent in _PERCENTS:
        # Integer ceil(percent * n / 100), free of floating-point rounding.
        rank = -(-percent * n // 100)
        result[key] = ordered[rank - 1] if n else None
    result["max"] = ordered[-1] if n else None
    result["mean"] = math.fsum(ordered) / n if n else None
    return result


@dataclass
class RunReport:
    """Everything a chaos run found. Times are seconds relative to the start of the run."""

    seed: int | None
    replay: str  # the command that replays this run
    workload: str  # the script's path or the workload function's name
    started_at: str  # ISO 8601, UTC
    wall_s: float
    schedule: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, Any] = field(default_factory=dict)
    faults: list[FaultRecord] = field(default_factory=list)
    # Every supervision event the owner saw, with the index of the fault it was attributed to.
    events: list[ObservedEvent] = field(default_factory=list)
    invariants: list[InvariantResult] = field(default_factory=list)
    workload_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when at least one invariant was checked and every invariant held."""
        return bool(self.invariants) and all(inv.held for inv in self.invariants)

    def failed_invariants(self) -> list[InvariantResult]:
        """The invariants that did not hold, in report order."""
        return [inv for inv in self.invariants if not inv.held]

    def to_dict(self) -> dict[str, Any]:
        """The report as a JSON-able dict following the ``meshvisor.chaos/1`` schema."""
        by_kind: dict[str, Any] = {}
        for kind in FAULT_KINDS:
            records = [r for r in self.faults if r.planned.fault.kind == kind]
            if records:
                by_kind[kind] = {"count": len(records), **_timing_percentiles(records)}
        return {
            "schema": SCHEMA,
            "ok": self.ok,
            "seed": self.seed,
            "replay": self.replay,
            "workload": self.workload,
            "started_at": self.started_at,
            "wall_s": self.wall_s,
            "schedule": self.schedule,
            "targets": self.targets,
            "faults": [r.to_dict() for r in self.faults],
            "events": [e.to_dict() for e in self.events],
            "percentiles": _timing_percentiles(self.faults),
            "by_kind": by_kind,
            "invariants": [inv.to_dict() for inv in self.invariants],
            "workload_stats": self.workload_stats,
        }

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """The report as JSON text (indent 2, keys in schema order); also written to `path`
        (UTF-8, with a final newline) when given. Non-finite floats raise ValueError."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=False, allow_nan=False)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunReport:
        """Rebuild a report from its dict (e.g. a loaded JSON file). The dict is first checked
        with `validate_report`: a wrong ``schema`` value or a malformed field raises ValueError.
        The derived keys (``ok``, ``percentiles``, ``by_kind``, each fault's ``description``,
        ``detect_s`` ...) are recomputed, not read."""
        validate_report(data)
        return cls(
            seed=data["seed"],
            replay=data["replay"],
            workload=data["workload"],
            started_at=data["started_at"],
            wall_s=float(data["wall_s"]),
            schedule=dict(data["schedule"]),
            targets=dict(data["targets"]),
            faults=[_fault_record_from_dict(r) for r in data["faults"]],
            events=[ObservedEvent.from_dict(dict(e)) for e in data["events"]],
            invariants=[InvariantResult.from_dict(dict(i)) for i in data["invariants"]],
            workload_stats=dict(data["workload_stats"]),
        )


def _timing_percentiles(records: Sequence[FaultRecord]) -> dict[str, Any]:
    detect = [r.detect_s for r in records if r.detect_s is not None]
    recover = [r.recover_s for r in records if r.recover_s is not None]
    return {"detect_s": percentiles(detect), "recover_s": percentiles(recover)}


def _fault_record_from_dict(data: dict[str, Any]) -> FaultRecord:
    """Rebuild a FaultRecord from `FaultRecord.to_dict` output (derived keys are ignored)."""
    planned = PlannedFault(
        data["at_s"], Fault.from_dict(dict(data["fault"])), Target.from_dict(dict(data["target"]))
    )
    return FaultRecord(
        index=data["index"],
        planned=planned,
        expected=tuple(data["expected_events"]),
        injected_at_s=data["injected_at_s"],
        detected_at_s=data["detected_at_s"],
        healthy_at_s=data["healthy_at_s"],
        observed=list(data["observed_events"]),
        verdict=data["verdict"],
        note=data["note"],
    )


# --- validation ------------------------------------------------------------------------------

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


def _object(fields: dict[str, _Check]) -> _Check:
    """An object with exactly the keys of `fields`, each passing its check."""

    def checked(value: Any, path: str) -> None:
        _any_object(value, path)
        for key, check in fields.items():
            if key not in value:
                _fail(_join(path, key), "required key is missing")
            check(value[key], _join(path, key))
        for key in value:
            if key not in fields:
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
    _object({"count": _count, **{k: _optional(_number) for k in _PERCENTILE_KEYS[1:]}})(value, path)
    for key in _PERCENTILE_KEYS[1:]:
        if (value[key] is None) != (value["count"] == 0):
            state = "null" if value[key] is None else "set"
            _fail(_join(path, key), f"is {state} but count is {value['count']}")


_target = _object(
    {
        "level": _one_of(("rank", "host", "client")),
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
    }
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


# --- rendering -------------------------------------------------------------------------------


def _ms(seconds: float | int | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f}"


def _verdict_text(verdict: str) -> Text:
    style = "green" if verdict == "ok" else "yellow" if verdict == "unexpected" else "bold red"
    return Text(verdict, style=style)


def _where(mesh: str | None, rank: int | None, host: int | None) -> str:
    if rank is not None:
        return f"{mesh} rank {rank}" if mesh else f"rank {rank}"
    if host is not None:
        return f"host {host}"
    return f"mesh {mesh}" if mesh else "client"


def _target_text(target: Target) -> str:
    return _where(target.mesh, target.rank, target.host)


def _event_target(event: ObservedEvent) -> str:
    where = _where(event.mesh, event.rank, event.host)
    return where + (f" pid {event.pid}" if event.pid is not None else "")


def _timeline(report: RunReport, width: int) -> Table:
    table = Table(
        title="Timeline (time: s after the start; detect, recover: ms after the injection)",
        title_justify="left",
    )
    table.add_column("time", justify="right", overflow="fold")
    table.add_column("#", justify="right", overflow="fold")
    # Fault descriptions are short: keep each on one line when the console is wide enough for
    # them and the other columns' usual widths (about 80 columns).
    longest = max((len(r.planned.fault.describe()) for r in report.faults), default=0)
    table.add_column("fault / event", overflow="fold", no_wrap=longest + 80 <= width)
    table.add_column("target", overflow="fold")
    table.add_column("expected → observed", overflow="fold")
    table.add_column("detect", justify="right", overflow="fold")
    table.add_column("recover", justify="right", overflow="fold")
    table.add_column("verdict", no_wrap=True, min_width=len("not_injected"))
    rows: list[tuple[float, int, list[Text]]] = []
    for record in report.faults:
        at = record.injected_at_s if record.injected_at_s is not None else record.planned.at_s
        what = Text(record.planned.fault.describe())
        expected = " ".join(record.expected) or "nothing"
        observed = " ".join(record.observed) or "nothing"
        cells = [
            Text(f"{at:.3f}"),
            Text(str(record.index)),
            what,
            Text(_target_text(record.planned.target)),
            Text(f"{expected} → {observed}"),
            Text(_ms(record.detect_s)),
            Text(_ms(record.recover_s)),
            _verdict_text(record.verdict),
        ]
        rows.append((at, 0, cells))
    for event in report.events:
        if event.fault is not None:
            continue
        what = Text(event.kind, style="bold")
        if event.message:
            what.append(f": {event.message}")
        cells = [
            Text(f"{event.at_s:.3f}"),
            Text("—"),
            what,
            Text(_event_target(event)),
            Text(f"— → {event.kind}"),
            Text("—"),
            Text("—"),
            _verdict_text("unexpected"),
        ]
        rows.append((event.at_s, 1, cells))
    for _, _, cells in sorted(rows, key=lambda row: (row[0], row[1])):
        table.add_row(*cells)
    return table


def _recovery(report: RunReport) -> Table:
    table = Table(title="Recovery (ms)", title_justify="left")
    table.add_column("faults", no_wrap=True)
    table.add_column("measure", no_wrap=True)
    for key in ("count", "p50", "p90", "p99", "max"):
        table.add_column(key, justify="right", no_wrap=True)
    data = report.to_dict()
    scopes: list[tuple[str, dict[str, Any]]] = [("all", data["percentiles"])]
    scopes += list(data["by_kind"].items())
    for scope, summary in scopes:
        for measure in ("detect_s", "recover_s"):
            stats = summary[measure]
            table.add_row(
                Text(scope),
                Text(measure.removesuffix("_s")),
                Text(str(stats["count"])),
                *(Text(_ms(stats[key])) for key in ("p50", "p90", "p99", "max")),
            )
    return table


def _invariants(report: RunReport) -> Table:
    table = Table(title="Invariants", title_justify="left")
    table.add_column("invariant", overflow="fold")
    table.add_column("held", justify="center", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for inv in report.invariants:
        name = Text(inv.name)
        if inv.builtin:
            name.append(" (builtin)", style="dim")
        held = Text("✓", style="green") if inv.held else Text("✗", style="bold red")
        table.add_row(name, held, Text(inv.detail))
    return table


def _verdict_line(report: RunReport) -> Text:
    if report.ok:
        return Text("PASSED: every invariant held", style="bold green")
    if not report.invariants:
        return Text("FAILED: no invariant was checked", style="bold red")
    n = len(report.failed_invariants())
    noun = "invariant" if n == 1 else "invariants"
    return Text(f"FAILED: {n} {noun} did not hold", style="bold red")


def render(report: RunReport, console: Console | None = None) -> None:
    """Print `report` for humans on `console` (a new stdout Console by default): a header with
    the seed, the wall time and the replay command, then the Timeline (every fault, and every
    event attributed to none, marked "unexpected"), Recovery percentiles overall and per fault
    kind, the Invariants, and a final PASSED / FAILED line."""
    console = console if console is not None else Console()
    seed = "none" if report.seed is None else str(report.seed)
    header = Text.assemble(
        ("chaos run", "bold"),
        f"  seed {seed}  wall {report.wall_s:.1f} s  replay: ",
        (report.replay, "cyan"),
    )
    console.print(header, soft_wrap=True)
    details = f"workload {report.workload}  started {report.started_at}"
    for key, value in report.workload_stats.items():
        details += f"  {key} {value}"
    console.print(Text(details, style="dim"), soft_wrap=True)
    console.print(_timeline(report, console.width))
    for record in report.faults:
        if record.note:
            note = f"  #{record.index} {record.planned.fault.describe()}: {record.note}"
            console.print(Text(note, style="dim"))
    console.print(_recovery(report))
    console.print(_invariants(report))
    console.print(_verdict_line(report), soft_wrap=True)


def render_text(report: RunReport) -> str:
    """`render` as plain text (120 columns, no colour), e.g. to attach to a pytest failure."""
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=120,
        color_system=None,
        no_color=True,
        force_terminal=False,
        force_jupyter=False,
        force_interactive=False,
        highlight=False,
        emoji=False,
        record=True,
    )
    render(report, console)
    return console.export_text(styles=False)
