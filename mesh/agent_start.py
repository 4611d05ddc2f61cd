"""What ``meshvisor agent`` does before it imports the agent: kept light (stdlib only below it),
so that it runs within milliseconds of the program's start."""

from __future__ import annotations

from mesh._agent.notices import hold_early_notices as hold_early_notices

__all__ = ["hold_early_notices"]
