"""Seeing and debugging a running mesh: the distributed debugger (``docs/debugger.md``)."""

from observe._debug_link import DebugClient as DebugClient
from observe._debug_prompt import debug as debug

__all__ = ("DebugClient", "debug")

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
