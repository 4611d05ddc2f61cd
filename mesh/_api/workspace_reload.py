"""After a workspace sync: reload the changed modules in running procs, or restart them
(``HostMesh.sync_workspace(reload=...)``). Procs spawned later import the new code anyway."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from mesh._api.actor_mesh import ActorMesh
from mesh._api.endpoint import EndpointRef
from mesh._api.proc_mesh import ProcMesh
from mesh._api.workspace import WorkspaceSync
from mesh._engine.builtins import RELOAD_WORKSPACE
from mesh._engine.future import Future
from mesh._engine.runtime import Runtime

#: What ``sync_workspace`` does to running procs: nothing, reload changed modules, restart.
Reload = Literal[False, "modules", "restart"]


def check_reload(reload: object, meshes: Sequence[object]) -> None:
    """TypeError or ValueError, before anything is sent, if `reload` and `meshes` disagree."""
    if reload not in (False, None, "modules", "restart"):
        raise ValueError(f"reload must be False, 'modules' or 'restart', not {reload!r}")
    wanted: type = ActorMesh if reload == "modules" else ProcMesh
    if reload and not meshes:
        raise ValueError(f"reload={reload!r} needs the meshes to act on: meshes=[...]")
    wrong = [mesh for mesh in meshes if not isinstance(mesh, wanted)]
    if reload and wrong:
        raise TypeError(
            f"reload={reload!r} acts on meshes of type {wanted.__name__} (the procs of an actor "
            f"mesh reload modules, a proc mesh restarts), not {wrong[0]!r}"
        )


def apply_reload(
    runtime: Runtime,
    sync: WorkspaceSync,
    reload: Reload,
    meshes: Sequence[Any],
    grace_s: float,
    timeout_s: float,
) -> WorkspaceSync:
    """`sync` with what `reload` did to `meshes` (nothing when the sync changed nothing)."""
    if not reload or not (sync.written or sync.deleted):
        return sync
    if reload == "modules":
        return dataclasses.replace(sync, reloaded=_reload_modules(sync, meshes, timeout_s))
    restarted = sum(_restart(runtime, procs, grace_s, timeout_s) for procs in meshes)
    return dataclasses.replace(sync, restarted=restarted)


def _reload_modules(
    sync: WorkspaceSync, meshes: Sequence[ActorMesh[Any]], timeout_s: float
) -> tuple[str, ...]:
    """Reload the modules of changed files in every proc of `meshes`; their names."""
    changed = sorted(sync.written)
    names: set[str] = set()
    for actors in meshes:
        ref: EndpointRef[[str, list[str]], list[str]] = EndpointRef(actors, RELOAD_WORKSPACE)
        for _, reloaded in ref.call(sync.name, changed).get(timeout_s):
            names.update(reloaded)
    return tuple(sorted(names))


def _restart(runtime: Runtime, procs: ProcMesh, grace_s: float, timeout_s: float) -> int:
    """Restart every proc of `procs` (with its actors) through the restart machinery; how
    many. ValueError if this process does not own them."""
    record = runtime.ownership.proc_mesh(procs.mesh_key)
    if record is None:
        raise ValueError(
            f"proc mesh {procs.name!r} was not spawned by this process (or was stopped), so "
            "it cannot restart it; ask its owner, or reload='modules'"
        )
    done: Future[None] = Future(runtime, f"the restart of proc mesh {procs.name!r}")
    why = "to run the synced workspace"
    runtime.call_soon_threadsafe(runtime.restarts.restart_all, record, grace_s, why, done)
    done.get(timeout_s + grace_s)
    return len(record.peers)
