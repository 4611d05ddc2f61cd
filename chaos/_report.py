"""The report of a chaos run: what it found, and its JSON form (schema ``meshvisor.chaos/1``,
see ``docs/chaos-report.md``). Validation is in `_validation`, the human view in `_render`."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ._faults import FAULT_KINDS, Fault
from ._model import FaultRecord, InvariantResult, ObservedEvent, PlannedFault
from ._percentiles import percentiles
from ._targets import Target
from ._validation import SCHEMA, validate_report


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
