"""The human view of a chaos report, rendered with rich: the fault timeline, recovery
percentiles, the invariants and a final PASSED / FAILED line."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._model import ObservedEvent
from ._report import RunReport
from ._targets import Target

#: How many events' evidence the report for people shows (the JSON report has all).
_EVIDENCE_SHOWN = 3


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
    return "job" if target.level == "job" else _where(target.mesh, target.rank, target.host)


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


def _print_evidence(report: RunReport, console: Console) -> None:
    """The evidence of the first events that carry some (a stack, where memory ran out)."""
    carrying = [event for event in report.events if event.evidence]
    if not carrying:
        return
    console.print(Text("Evidence (the root cause of each event, trimmed)", style="bold"))
    for event in carrying[:_EVIDENCE_SHOWN]:
        fault = f"#{event.fault} " if event.fault is not None else ""
        title = f"  {event.at_s:.3f} s {fault}{event.kind} {_event_target(event)}:"
        console.print(Text(title), soft_wrap=True)
        for line in event.evidence.splitlines():
            console.print(Text(f"    {line}", style="dim"), soft_wrap=True)
    if len(carrying) > _EVIDENCE_SHOWN:
        more = len(carrying) - _EVIDENCE_SHOWN
        console.print(Text(f"  ... {more} more event(s) with evidence in the JSON report"))


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
    _print_evidence(report, console)
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
