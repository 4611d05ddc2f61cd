"""What an agent tells a debugger front end about its procs: where each ready one listens, so
that the front end can ask them directly (over ipc in the run directory, or authenticated tcp)."""

from __future__ import annotations

from mesh._agent.procs import ProcTable
from mesh._engine.debug_messages import ListProcs, ProcList

__all__ = ("ListProcs", "listed_procs")


def listed_procs(procs: ProcTable, host: str) -> ProcList:
    """This agent's host and the (proc id, address) of each of its procs that is ready."""
    ready = tuple((p.proc_id, p.address) for p in procs if p.connected and not p.stop_requested)
    return ProcList(host, ready)
