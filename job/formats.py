"""SLURM's own formats, read robustly across versions: ``scontrol show ... -o`` records,
durations, host lists and node states (the parsers `SlurmJob` uses; see `job._formats`)."""

from job._formats import NodeState as NodeState
from job._formats import SlurmFormatError as SlurmFormatError
from job._formats import expand_hostlist as expand_hostlist
from job._formats import format_duration as format_duration
from job._formats import parse_duration as parse_duration
from job._formats import parse_key_values as parse_key_values
from job._formats import parse_node_state as parse_node_state
from job._formats import parse_records as parse_records
from job._formats import pending_reason as pending_reason

__all__ = (
    "NodeState",
    "SlurmFormatError",
    "expand_hostlist",
    "format_duration",
    "parse_duration",
    "parse_key_values",
    "parse_node_state",
    "parse_records",
    "pending_reason",
)
