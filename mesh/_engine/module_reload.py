"""Reloading the modules of a synced workspace in a running proc (``sync_workspace(reload=
"modules")``): every module loaded from a file the sync changed is run again in place."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

from mesh._engine.workspace_files import WORKSPACES_ENV, name_problem, path_problem


def workspace_folder(name: str) -> str:
    """Where workspace `name` lives on this proc's host (its agent says where, in the
    environment); LookupError in a process that no host agent started."""
    root = os.environ.get(WORKSPACES_ENV)
    if not root:
        raise LookupError(
            f"this process was not started by a host agent ({WORKSPACES_ENV} is not set), so "
            "it has no synced workspaces to reload"
        )
    return os.path.join(root, name)


def reload_changed(name: str, paths: Sequence[str]) -> list[str]:
    """Put workspace `name` on ``sys.path`` (a proc started before its first sync lacks it)
    and reload the modules loaded from `paths` (relative to it), in the order they were
    first imported; the names of those reloaded."""
    problem = name_problem(name) or next(filter(None, map(path_problem, paths)), None)
    if problem is not None:
        raise ValueError(f"cannot reload workspace modules: {problem}")
    folder = workspace_folder(name)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    importlib.invalidate_caches()
    changed = {os.path.join(folder, *path.split("/")) for path in paths}
    reloaded = []
    for module_name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and os.path.realpath(file) in changed:
            importlib.reload(module)
            reloaded.append(module_name)
    return reloaded
