"""Chaos engineering for meshvisor jobs: seeded fault injection, invariants and reports.

``run_chaos(workload, schedule)`` runs a workload function on a fresh local allocation (or a
SLURM job), injects the schedule's faults (kills, pauses, raised exceptions, dropped or delayed
messages, partitions, killed agents, a killed client; on SLURM lost nodes and preemption
notices), measures detection and recovery, checks the invariants and returns a `RunReport`.
Also available as a pytest plugin and as ``meshvisor chaos run`` / ``python -m chaos run``.

Each fault kind is one `FaultSpec` in `FAULT_SPECS` (its target level, expected events, how it
is drawn, injected and healed). `REPORT_SCHEMA`, `VERDICTS` and `percentiles` define the JSON
report; `replay_command` and `build_parser` are the command line that replays a run.
"""

from ._cli import build_parser as build_parser
from ._errors import ChaosSetupError as ChaosSetupError
from ._errors import InjectedError as InjectedError
from ._errors import InjectedFault as InjectedFault
from ._faults import FAULT_KINDS as FAULT_KINDS
from ._faults import FAULT_SPECS as FAULT_SPECS
from ._faults import Fault as Fault
from ._faults import FaultSpec as FaultSpec
from ._harness import replay_command as replay_command
from ._harness import run_chaos as run_chaos
from ._job import Job as Job
from ._model import VERDICTS as VERDICTS
from ._model import FaultRecord as FaultRecord
from ._model import InvariantResult as InvariantResult
from ._model import ObservedEvent as ObservedEvent
from ._model import PlannedFault as PlannedFault
from ._options import ChaosOptions as ChaosOptions
from ._percentiles import percentiles as percentiles
from ._render import render as render
from ._render import render_text as render_text
from ._report import RunReport as RunReport
from ._schedule import RandomSchedule as RandomSchedule
from ._schedule import Schedule as Schedule
from ._schedule import ScriptedSchedule as ScriptedSchedule
from ._targets import Target as Target
from ._targets import TargetSet as TargetSet
from ._validation import SCHEMA as REPORT_SCHEMA
from ._validation import validate_report as validate_report

__all__ = (
    "FAULT_KINDS",
    "FAULT_SPECS",
    "REPORT_SCHEMA",
    "VERDICTS",
    "ChaosOptions",
    "ChaosSetupError",
    "Fault",
    "FaultRecord",
    "FaultSpec",
    "InjectedError",
    "InjectedFault",
    "InvariantResult",
    "Job",
    "ObservedEvent",
    "PlannedFault",
    "RandomSchedule",
    "RunReport",
    "Schedule",
    "ScriptedSchedule",
    "Target",
    "TargetSet",
    "build_parser",
    "percentiles",
    "render",
    "render_text",
    "replay_command",
    "run_chaos",
    "validate_report",
)
