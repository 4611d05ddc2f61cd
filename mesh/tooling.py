"""What meshvisor's own tools read of running meshes: the parts of the engine that `observe`
(the live view, logs and the debugger) and `job` (SLURM jobs) build on; and `any_done`, with
which `recovery` waits for the first of several calls to end.

Users' scripts do not need these; they are public so that those packages depend on named,
stable entry points rather than on the engine's private modules (an import-linter contract
holds them to that). Each name is re-exported from the one module that defines it.
"""

from __future__ import annotations

from mesh._agent.allocations import allocation_keys_dir as allocation_keys_dir
from mesh._agent.allocations import read_allocation as read_allocation
from mesh._agent.log_files import ALLOCATION_PREFIX as ALLOCATION_PREFIX
from mesh._agent.log_files import logs_home as logs_home
from mesh._agent.log_records import LEVELS as LEVELS
from mesh._agent.log_records import level_at_least as level_at_least
from mesh._api.attach import use_allocation_keys as use_allocation_keys
from mesh._engine.debug_messages import DebugInput as DebugInput
from mesh._engine.debug_messages import DebugOutput as DebugOutput
from mesh._engine.debug_messages import DebugQuery as DebugQuery
from mesh._engine.debug_messages import DebugSessions as DebugSessions
from mesh._engine.debug_messages import ListProcs as ListProcs
from mesh._engine.debug_messages import PausedCall as PausedCall
from mesh._engine.debug_messages import ProcList as ProcList
from mesh._engine.future import any_done as any_done
from mesh._engine.messages import invalid_fields as invalid_fields
from mesh._engine.run_dirs import OWNER_FILE as OWNER_FILE
from mesh._engine.run_dirs import sweep_stale_run_dirs as sweep_stale_run_dirs
from mesh._engine.run_dirs import write_owner_file as write_owner_file
from mesh._engine.session import current_session as current_session
from mesh._engine.view_messages import ActorView as ActorView
from mesh._engine.view_messages import EventView as EventView
from mesh._engine.view_messages import HostSnapshot as HostSnapshot
from mesh._engine.view_messages import ProcView as ProcView
from mesh._engine.view_messages import SnapshotQuery as SnapshotQuery

__all__ = [
    "ALLOCATION_PREFIX",
    "LEVELS",
    "OWNER_FILE",
    "ActorView",
    "DebugInput",
    "DebugOutput",
    "DebugQuery",
    "DebugSessions",
    "EventView",
    "HostSnapshot",
    "ListProcs",
    "PausedCall",
    "ProcList",
    "ProcView",
    "SnapshotQuery",
    "allocation_keys_dir",
    "any_done",
    "current_session",
    "invalid_fields",
    "level_at_least",
    "logs_home",
    "read_allocation",
    "sweep_stale_run_dirs",
    "use_allocation_keys",
    "write_owner_file",
]
