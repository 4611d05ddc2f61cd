"""The host agent: a daemon per host that spawns procs through its fork server and watches them.

Runs as its own process (``meshvisor agent`` or ``python -m mesh._agent``); `proc_main` is what
each forked proc runs.
"""
