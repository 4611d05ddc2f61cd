"""Tools to look at a running or finished meshvisor job from the command line.

``meshvisor logs`` (`observe._logs_cli`) shows, tails, follows and filters the per-rank log
files that host agents keep of every proc's output; `read_logs` and `LogFilter` read them from
Python. The command line front ends live here; what they read is written by the `mesh` layer.
"""

from ._logs_read import LogFilter as LogFilter
from ._logs_read import LogsError as LogsError
from ._logs_read import read_logs as read_logs

__all__ = ("LogFilter", "LogsError", "read_logs")
