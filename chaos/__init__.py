"""Chaos engineering for meshvisor jobs: seeded fault injection, invariants and reports.

``run_chaos(workload, schedule)`` runs a workload function on a fresh local allocation,
injects the schedule's faults (kills, pauses, raised exceptions, dropped or delayed messages,
partitions, killed agents, a killed client), measures detection and recovery, checks the
invariants and returns a `RunReport`. Also available as a pytest plugin and as
``meshvisor chaos run`` / ``python -m chaos run``.
"""

from ._errors import ChaosSetupError as ChaosSetupError
from ._errors import InjectedError as InjectedError
from ._errors import InjectedFault as InjectedFault
from ._harness import ChaosOptions as ChaosOptions
from ._harness import run_chaos as run_chaos
from ._job import Job as Job
from ._model import FAULT_KINDS as FAULT_KINDS
from ._model import Fault as Fault
from ._model import FaultRecord as FaultRecord
from ._model import InvariantResult as InvariantResult
from ._model import ObservedEvent as ObservedEvent
from ._model import PlannedFault as PlannedFault
from ._model import Target as Target
from ._model import TargetSet as TargetSet
from ._report import RunReport as RunReport
from ._report import render as render
from ._report import render_text as render_text
from ._report import validate_report as validate_report
from ._schedule import RandomSchedule as RandomSchedule
from ._schedule import Schedule as Schedule
from ._schedule import ScriptedSchedule as ScriptedSchedule

__all__ = (
    "FAULT_KINDS",
    "ChaosOptions",
    "ChaosSetupError",
    "Fault",
    "FaultRecord",
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
    "render",
    "render_text",
    "run_chaos",
    "validate_report",
)
