"""Tools to see a running mesh from the terminal: the live supervision tree (``meshvisor top``).

The command-line front ends live here, each in its own `_`-prefixed module; they reach agents
through their authenticated channels and never become owners of what they show.
"""

__all__: tuple[str, ...] = ()
