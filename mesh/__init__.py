"""The programming model: actors, endpoints and meshes of hosts, procs and actors."""

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

for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) or callable(_obj):
        try:
            _obj.__module__ = __name__
        except (AttributeError, TypeError):
            pass
del _name, _obj

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
    moved_to = _MOVED.get(name)
    if moved_to is not None:
        # An ImportError (not AttributeError) so that `from mesh import X` shows this message.
        raise ImportError(f"mesh.{name} moved to {moved_to}: use `from {moved_to} import {name}`.")
    raise AttributeError(f"module 'mesh' has no attribute {name!r}")
