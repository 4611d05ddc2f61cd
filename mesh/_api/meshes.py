"""Mesh handles: `HostMesh` → `ProcMesh` → `ActorMesh`, all sliceable like arrays.

Each lives in its own module; this one gathers them for the modules that import them here.
"""

from mesh._api.actor_mesh import ActorMesh as ActorMesh
from mesh._api.host_mesh import HostMesh as HostMesh
from mesh._api.host_mesh import heartbeat_settings as heartbeat_settings
from mesh._api.host_mesh import this_host as this_host
from mesh._api.proc_mesh import ProcMesh as ProcMesh
from mesh._api.proc_mesh import this_proc as this_proc
