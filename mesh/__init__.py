"""The programming model: actors, endpoints and meshes of hosts, procs and actors."""

from ._actor import Actor as Actor
from ._actor import EndpointDef as EndpointDef
from ._actor import endpoint as endpoint
from ._attach import attach as attach
from ._context import Context as Context
from ._context import context as context
from ._context import current_rank as current_rank
from ._context import current_size as current_size
from ._endpoint import EndpointRef as EndpointRef
from ._faults import Party as Party
from ._faults import break_links as break_links
from ._faults import exit_process as exit_process
from ._faults import fail_next_call as fail_next_call
from ._faults import heal_links as heal_links
from ._faults import probe as probe
from ._future import Future as Future
from ._meshes import ActorMesh as ActorMesh
from ._meshes import HostMesh as HostMesh
from ._meshes import ProcMesh as ProcMesh
from ._meshes import this_host as this_host
from ._meshes import this_proc as this_proc
from ._placement import Placement as Placement
from ._placement import placement as placement
from ._replica import Replica as Replica
from ._replica import digest as parameter_digest
from ._replica import replay_training as replay_training
from ._replicas import Recovery as Recovery
from ._replicas import ReplicaGroup as ReplicaGroup
from ._replicas import ReplicaGroupError as ReplicaGroupError
from ._replicas import StepOutcome as StepOutcome
from ._shape import Extent as Extent
from ._shape import Point as Point
from ._supervised import supervised as supervised
from ._values import ValueMesh as ValueMesh

__all__ = (
    "Actor",
    "ActorMesh",
    "Context",
    "EndpointDef",
    "EndpointRef",
    "Extent",
    "Future",
    "HostMesh",
    "Party",
    "Placement",
    "Point",
    "ProcMesh",
    "Recovery",
    "Replica",
    "ReplicaGroup",
    "ReplicaGroupError",
    "StepOutcome",
    "ValueMesh",
    "attach",
    "break_links",
    "context",
    "current_rank",
    "current_size",
    "endpoint",
    "exit_process",
    "fail_next_call",
    "heal_links",
    "parameter_digest",
    "placement",
    "probe",
    "replay_training",
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
