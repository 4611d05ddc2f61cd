"""Tools to see and debug a running or finished meshvisor job.

``meshvisor logs`` (`observe._logs_cli`) shows, tails, follows and filters the per-rank log
files that host agents keep of every proc's output; `read_logs` and `LogFilter` read them from
Python. ``meshvisor top`` (`observe._top`) shows the live supervision tree of a client or an
allocation. ``meshvisor debug``, `debug()` and `DebugClient` debug calls paused in
``breakpoint()`` (docs/debugger.md). The front ends reach agents and procs through their
authenticated channels and never become owners of what they show.
"""

from observe._debug_link import DebugClient as DebugClient
from observe._debug_prompt import debug as debug
from observe._logs_read import LogFilter as LogFilter
from observe._logs_read import LogsError as LogsError
from observe._logs_read import read_logs as read_logs

__all__ = ("DebugClient", "LogFilter", "LogsError", "debug", "read_logs")

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
