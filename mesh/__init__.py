"""The programming model: actors, endpoints and meshes of hosts, procs and actors.

Each public name is loaded at its first use (PEP 562), along with those whose modules are
loaded by then: a host agent imports only the internals it runs on (``mesh._agent``,
``mesh._engine``), not the client API, so that it starts sooner; and a proc that unpickles an
actor class (whose base is ``mesh.Actor``) loads ``Actor``, not the client API besides it.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mesh._actor import Actor as Actor
    from mesh._actor import EndpointDef as EndpointDef
    from mesh._actor import concurrent_endpoint as concurrent_endpoint
    from mesh._actor import endpoint as endpoint
    from mesh._api.accumulate import Accumulator as Accumulator
    from mesh._api.accumulate import ReducerError as ReducerError
    from mesh._api.actor_mesh import ActorMesh as ActorMesh
    from mesh._api.attach import attach as attach
    from mesh._api.bootstrap import BootstrapCommand as BootstrapCommand
    from mesh._api.channel import Channel as Channel
    from mesh._api.channel import Port as Port
    from mesh._api.channel import PortReceiver as PortReceiver
    from mesh._api.configure import configure as configure
    from mesh._api.configure import configured as configured
    from mesh._api.controllers import get_or_spawn_controller as get_or_spawn_controller
    from mesh._api.detached import AdoptionError as AdoptionError
    from mesh._api.detached import DetachedMeshInfo as DetachedMeshInfo
    from mesh._api.endpoint import EndpointRef as EndpointRef
    from mesh._api.host_mesh import HostMesh as HostMesh
    from mesh._api.host_mesh import this_host as this_host
    from mesh._api.placement import Placement as Placement
    from mesh._api.placement import placement as placement
    from mesh._api.proc_mesh import ProcMesh as ProcMesh
    from mesh._api.proc_mesh import this_proc as this_proc
    from mesh._api.supervised import supervised as supervised
    from mesh._api.workers import attach_to_workers as attach_to_workers
    from mesh._api.workers import run_worker_loop_forever as run_worker_loop_forever
    from mesh._api.workers import run_worker_loop_until_shutdown as run_worker_loop_until_shutdown
    from mesh._api.workspace import HostSync as HostSync
    from mesh._api.workspace import SyncProgress as SyncProgress
    from mesh._api.workspace import WorkspaceSync as WorkspaceSync
    from mesh._context import ActorAborted as ActorAborted
    from mesh._context import ActorInstance as ActorInstance
    from mesh._context import Context as Context
    from mesh._context import context as context
    from mesh._context import current_rank as current_rank
    from mesh._context import current_size as current_size
    from mesh._engine.future import Future as Future
    from mesh._engine.workspace_files import WorkspaceError as WorkspaceError
    from mesh._settings import Settings as Settings
    from mesh._settings import current_settings as current_settings
    from mesh._shape import Extent as Extent
    from mesh._shape import Point as Point
    from mesh._values import ValueMesh as ValueMesh

__all__ = (
    "Accumulator",
    "Actor",
    "ActorAborted",
    "ActorInstance",
    "ActorMesh",
    "AdoptionError",
    "BootstrapCommand",
    "Channel",
    "Context",
    "DetachedMeshInfo",
    "EndpointDef",
    "EndpointRef",
    "Extent",
    "Future",
    "HostMesh",
    "HostSync",
    "Placement",
    "Point",
    "Port",
    "PortReceiver",
    "ProcMesh",
    "ReducerError",
    "Settings",
    "SyncProgress",
    "ValueMesh",
    "WorkspaceError",
    "WorkspaceSync",
    "attach",
    "attach_to_workers",
    "concurrent_endpoint",
    "configure",
    "configured",
    "context",
    "current_rank",
    "current_settings",
    "current_size",
    "endpoint",
    "get_or_spawn_controller",
    "placement",
    "run_worker_loop_forever",
    "run_worker_loop_until_shutdown",
    "supervised",
    "this_host",
    "this_proc",
)

#: Where each public name is defined.
_HOMES = {
    "Accumulator": "mesh._api.accumulate",
    "Actor": "mesh._actor",
    "ActorAborted": "mesh._context",
    "ActorInstance": "mesh._context",
    "ActorMesh": "mesh._api.actor_mesh",
    "AdoptionError": "mesh._api.detached",
    "BootstrapCommand": "mesh._api.bootstrap",
    "Channel": "mesh._api.channel",
    "Context": "mesh._context",
    "DetachedMeshInfo": "mesh._api.detached",
    "EndpointDef": "mesh._actor",
    "EndpointRef": "mesh._api.endpoint",
    "Extent": "mesh._shape",
    "Future": "mesh._engine.future",
    "HostMesh": "mesh._api.host_mesh",
    "HostSync": "mesh._api.workspace",
    "Placement": "mesh._api.placement",
    "Point": "mesh._shape",
    "Port": "mesh._api.channel",
    "PortReceiver": "mesh._api.channel",
    "ProcMesh": "mesh._api.proc_mesh",
    "ReducerError": "mesh._api.accumulate",
    "Settings": "mesh._settings",
    "SyncProgress": "mesh._api.workspace",
    "ValueMesh": "mesh._values",
    "WorkspaceError": "mesh._engine.workspace_files",
    "WorkspaceSync": "mesh._api.workspace",
    "attach": "mesh._api.attach",
    "attach_to_workers": "mesh._api.workers",
    "concurrent_endpoint": "mesh._actor",
    "configure": "mesh._api.configure",
    "configured": "mesh._api.configure",
    "context": "mesh._context",
    "current_rank": "mesh._context",
    "current_settings": "mesh._settings",
    "current_size": "mesh._context",
    "endpoint": "mesh._actor",
    "get_or_spawn_controller": "mesh._api.controllers",
    "placement": "mesh._api.placement",
    "run_worker_loop_forever": "mesh._api.workers",
    "run_worker_loop_until_shutdown": "mesh._api.workers",
    "supervised": "mesh._api.supervised",
    "this_host": "mesh._api.host_mesh",
    "this_proc": "mesh._api.proc_mesh",
}

_MISSING = object()

#: Names that moved out of `mesh`, and where they live now.
_MOVED = {
    **dict.fromkeys(
        (
            *("Recovery", "Replica", "ReplicaGroup", "ReplicaGroupError", "StepOutcome"),
            *("parameter_digest", "replay_training"),
        ),
        "recovery",
    ),
    **dict.fromkeys(
        ("Party", "break_links", "exit_process", "fail_next_call", "heal_links", "probe"),
        "mesh.testing",
    ),
}


def __getattr__(name: str) -> object:
    if name in _HOMES:
        return _load_public_name(name)
    moved_to = _MOVED.get(name)
    if moved_to is not None:
        # An ImportError (not AttributeError) so that `from mesh import X` shows this message.
        raise ImportError(f"mesh.{name} moved to {moved_to}: use `from {moved_to} import {name}`.")
    raise AttributeError(f"module 'mesh' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _load_public_name(name: str) -> object:
    """Import `name` from its home, then present it and every other public name whose home is
    loaded by now as ``mesh.NAME`` (so that reprs and tracebacks read the public path)."""
    value = getattr(importlib.import_module(_HOMES[name]), name)
    for public, home in _HOMES.items():
        obj = getattr(sys.modules.get(home), public, _MISSING)  # a home still importing: later
        if obj is not _MISSING and public not in globals():
            _present(obj)
            globals()[public] = obj
    return value


def _present(obj: object) -> None:
    if isinstance(obj, type) or callable(obj):
        try:
            obj.__module__ = __name__
        except (AttributeError, TypeError):
            pass
