"""An actor that imports code from a synced workspace (tests/test_workspace_sync.py)."""

from __future__ import annotations

import importlib
import os
from typing import Any

from mesh import Actor, endpoint


class Importer(Actor):
    """Reads attributes of modules it imports by name, and files of its host."""

    @endpoint
    def value(self, module: str, attribute: str) -> Any:
        return getattr(importlib.import_module(module), attribute)

    @endpoint
    def origin(self, module: str) -> str:
        return str(importlib.import_module(module).__file__)

    @endpoint
    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    @endpoint
    def pid(self) -> int:
        return os.getpid()
