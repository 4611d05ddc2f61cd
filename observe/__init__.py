"""Tools to look at a running or finished meshvisor job from the command line.

``meshvisor logs`` (`observe._logs_cli`) shows, tails, follows and filters the per-rank log
files that host agents keep of every proc's output. The command line front ends live here;
what they read is written by the `mesh` layer.
"""

__all__: tuple[str, ...] = ()
