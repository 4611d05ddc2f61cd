"""Running in a Jupyter kernel (or any IPython shell): failures reach a cell, never the kernel,
and procs' lines show under the cell that called their mesh.

Between cells the kernel's main thread runs the kernel's own event loop: fail-fast's signal
raising a `SupervisionError` there would end the kernel. `CellGate` lets fail-fast raise only
while a cell's code is on the main thread's stack, and a statement put first in every cell
raises what was held back meanwhile. `CellRouting` remembers, per proc mesh, the cell that last
sent it a call, so that the writer thread of proc output writes the mesh's lines under that cell
(ipykernel's per-thread parent header), also after the cell has finished.
"""

from __future__ import annotations

import ast
import contextlib
import sys
import threading
from types import FrameType
from typing import Any, TextIO

from mesh._engine.failfast import FailFast

#: The call put first in every cell: raise the failures held back since the last cell.
_DELIVER = "__import__('mesh._engine.notebook', fromlist=['_']).deliver_held_failures()"
#: Proc meshes whose calling cell is remembered at most (the oldest are forgotten beyond).
_MAX_MESHES = 4096


def ipython_shell() -> Any | None:
    """The running IPython shell (a Jupyter kernel's, a terminal's), or None outside IPython."""
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    if get_ipython is None:
        return None  # not imported: no shell can be running
    with contextlib.suppress(Exception):
        return get_ipython()
    return None


class CellGate:
    """Fail-fast's `MainThreadGate` in an IPython shell: signal the main thread only while a
    cell runs, and raise only where the cell's own code is on the stack."""

    def __init__(self, shell: Any) -> None:
        self._shell = shell
        self._cell_running = False

    def may_interrupt(self) -> bool:
        return self._cell_running

    def may_raise(self, frame: FrameType | None) -> bool:
        user_globals = self._shell.user_global_ns
        while frame is not None:
            if frame.f_globals is user_globals and frame.f_code.co_name == "<module>":
                return True  # a cell's top-level code: whatever raises here ends the cell
            frame = frame.f_back
        return False

    def on_pre_execute(self) -> None:
        self._cell_running = True

    def on_post_execute(self) -> None:
        self._cell_running = False


class _DeliverFirst(ast.NodeTransformer):
    """Puts the delivery of held failures before the first statement of each cell."""

    def visit_Module(self, node: ast.Module) -> ast.Module:
        statement = ast.parse(_DELIVER).body[0]
        line = node.body[0].lineno if node.body else 1
        for part in ast.walk(statement):
            if isinstance(part, (ast.expr, ast.stmt)):
                part.lineno, part.end_lineno = line, line
                part.col_offset, part.end_col_offset = 0, 0
        node.body.insert(0, statement)
        return node


class CellRouting:
    """Which cell each proc mesh's lines go under: the cell that last sent the mesh a call."""

    def __init__(self, shell: Any) -> None:
        self._kernel = getattr(shell, "kernel", None)
        self._parents: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def called(self, mesh_key: str) -> None:
        """A message goes to mesh `mesh_key`: remember the cell running now, if any."""
        parent = self._current_parent()
        if not parent:
            return
        with self._lock:
            self._parents.pop(mesh_key, None)
            self._parents[mesh_key] = parent
            if len(self._parents) > _MAX_MESHES:
                del self._parents[next(iter(self._parents))]

    def write(self, target: TextIO, text: str, mesh_key: str | None) -> None:
        """Write `text` to `target` under the cell that last called `mesh_key` (else where
        the kernel puts a thread's output: the running cell, or the last one)."""
        with self._lock:
            parent = self._parents.get(mesh_key) if mesh_key is not None else None
        set_parent = getattr(target, "set_thread_parent", None)  # ipykernel >= 7
        if parent is None or set_parent is None:
            target.write(text)
            target.flush()
            return
        token = set_parent(parent)
        try:
            target.write(text)
            target.flush()
        finally:
            target.reset_thread_parent(token)  # type: ignore[attr-defined]

    def _current_parent(self) -> dict[str, Any] | None:
        if self._kernel is None or threading.current_thread() is not threading.main_thread():
            return None
        with contextlib.suppress(Exception):
            parent = self._kernel.get_parent("shell")
            return parent if isinstance(parent, dict) and parent.get("header") else None
        return None


_ROUTING: CellRouting | None = None
_FAIL_FAST: FailFast | None = None


def install(fail_fast: FailFast) -> bool:
    """Adapt fail-fast and proc output to the IPython shell this runs in, if any (main thread
    only; idempotent). True if one was found."""
    global _ROUTING, _FAIL_FAST
    shell = ipython_shell()
    if shell is None or threading.current_thread() is not threading.main_thread():
        return False
    if _FAIL_FAST is not None:
        return True
    gate = CellGate(shell)
    shell.events.register("pre_execute", gate.on_pre_execute)
    shell.events.register("post_execute", gate.on_post_execute)
    gate.on_pre_execute()  # installed from a running cell
    shell.ast_transformers.append(_DeliverFirst())
    fail_fast.set_gate(gate)
    _FAIL_FAST, _ROUTING = fail_fast, CellRouting(shell)
    return True


def in_notebook() -> bool:
    """Whether this client runs in an IPython shell it has adapted to (`install`)."""
    return _ROUTING is not None


def deliver_held_failures() -> None:
    """Raise the failures held back since the last cell (the first statement of each cell)."""
    if _FAIL_FAST is not None:
        _FAIL_FAST.deliver_pending()


def note_call(mesh_key: str) -> None:
    """A message goes to proc mesh `mesh_key` (its lines go under the cell running now)."""
    if _ROUTING is not None:
        _ROUTING.called(mesh_key)


def write_output(target: TextIO, text: str, mesh_key: str | None) -> None:
    """Write proc lines to `target`: under their mesh's cell in a notebook, else plainly."""
    if _ROUTING is not None:
        _ROUTING.write(target, text, mesh_key)
    else:
        target.write(text)
        target.flush()
