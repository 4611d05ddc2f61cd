"""Tools to see a running or finished meshvisor job from the terminal.

``meshvisor logs`` (`observe._logs_cli`) shows, tails, follows and filters the per-rank log
files that host agents keep of every proc's output; `read_logs` and `LogFilter` read them from
Python. ``meshvisor top`` (`observe._top`) shows the live supervision tree of a client or an
allocation. The command-line front ends live here, each in its own `_`-prefixed module; they
reach agents through their authenticated channels and never become owners of what they show.
"""

from ._logs_read import LogFilter as LogFilter
from ._logs_read import LogsError as LogsError
from ._logs_read import read_logs as read_logs

__all__ = ("LogFilter", "LogsError", "read_logs")
