"""`PausedSession`: one call paused in pdb, whose commands come from a debugger front end.

pdb reads its commands from the session (`readline` waits for a `DebugInput` line) and writes
to it (`write`); what it printed up to its next prompt goes to the front end that sent the
command. The session ends when pdb lets the call go on (``continue`` with no breakpoint set, or
``quit``, which raises ``BdbQuit`` in the call).
"""

from __future__ import annotations

import dis
import inspect
import os
import pdb
import re
import threading
from collections import deque
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from mesh._engine.debug_messages import (
    MAX_LINE_CHARS,
    MAX_OUTPUT_CHARS,
    DebugOutput,
    PausedCall,
)
from mesh._engine.future import Future

PROMPT = "(Pdb) "
#: Code whose frames return at each suspension (an ``await``), not only at their end.
_SUSPENDABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR
#: Modules of the runtime (and of the event loop and threads beneath it): pdb does not stop
#: in them, and `where` starts at the first frame outside them (the endpoint, usually).
RUNTIME_MODULES = (
    *("mesh._*", "transport.*", "anyio", "anyio.*", "asyncio", "asyncio.*", "sniffio*"),
    *("threading", "concurrent.futures*", "contextvars", "contextlib", "selectors"),
)


class PausedSession:
    """One paused call: pdb's input and output, and what the front ends see of it."""

    def __init__(
        self,
        number: int,
        frame: FrameType,
        *,
        wait_for_line: Callable[[Future[Any]], None],
        send: Callable[[str, Any], None],
        on_resumed: Callable[[PausedSession], None],
    ) -> None:
        self.number = number
        self.waiting = False  # pdb waits for a command (the call is stopped at a line)
        self.actor_id = self.mesh_name = self.point = self.proc_id = self.host = ""
        self._frame = frame
        self._wait_for_line = wait_for_line
        self._send = send
        self._on_resumed = on_resumed
        self._lines: deque[tuple[str, str]] = deque()
        self._arrived: Future[None] | None = None
        self._lock = threading.Lock()
        self._written: list[str] = []
        self._reply_to: str | None = None
        self._ended = False
        self.actor_class = type(frame.f_locals.get("self", None)).__name__
        self.debugger = SessionPdb(self)

    def describe(
        self, *, proc_id: str, actor_id: str, mesh_name: str, point: str, host: str
    ) -> None:
        """Say where this call runs (from the context of the paused thread)."""
        self.proc_id, self.actor_id, self.mesh_name = proc_id, actor_id, mesh_name
        self.point, self.host = point, host

    def describe_short(self) -> str:
        """Its actor mesh and rank, as ``attach`` names it: ``trainers 0``."""
        return f"{self.mesh_name or self.proc_id} {self._home_rank()}"

    def _home_rank(self) -> int:
        """Its rank in the mesh it was spawned in (its actor id ends in ``[rank]``), or -1."""
        found = re.search(r"\[(\d+)\]$", self.actor_id)
        return int(found.group(1)) if found else -1

    def paused_call(self) -> PausedCall:
        """This session as the front ends list it."""
        frame: FrameType = getattr(self.debugger, "curframe", None) or self._frame
        return PausedCall(
            self.number,
            self.proc_id,
            self.mesh_name,
            self.actor_class,
            self._home_rank(),
            self.point,
            self.host,
            os.getpid(),
            frame.f_code.co_filename,
            frame.f_lineno,
            frame.f_code.co_name,
            self._where(),
        )

    def _where(self) -> str:
        """Where pdb stands, as its ``where`` shows the current frame."""
        debugger = self.debugger
        stack, index = getattr(debugger, "stack", None), getattr(debugger, "curindex", 0)
        if not stack or index >= len(stack):  # pdb is between two stops
            return ""
        return "> " + debugger.format_stack_entry(stack[index], "\n-> ")[:MAX_LINE_CHARS] + "\n"

    # -- commands from the front ends (any thread) ---------------------------------------------

    def give(self, line: str, reply_to: str) -> None:
        """Queue a command for pdb; its output goes to `reply_to`."""
        with self._lock:
            self._lines.append((line, reply_to))
            arrived, self._arrived = self._arrived, None
        if arrived is not None:
            arrived.set_result(None)

    # -- pdb's input and output (the paused thread) --------------------------------------------

    def write(self, text: str) -> int:
        self._written.append(text)
        return len(text)

    def flush(self) -> None:
        """Output is sent when pdb waits for its next command."""

    def readline(self) -> str:
        """pdb's next command: send what it printed so far, then wait for a line."""
        text = self._take_written()
        self.waiting = True  # before the output goes: its reader may ask for `list` at once
        if self._reply_to is not None:
            self._send(self._reply_to, DebugOutput(self.proc_id, self.number, text, False))
        line, self._reply_to = self._next_line()
        return line + "\n"

    def _next_line(self) -> tuple[str, str]:
        while True:
            with self._lock:
                if self._lines:
                    self.waiting = False
                    return self._lines.popleft()
                arrived = self._arrived = Future(description="a debugger command")
                self.waiting = True
            self._wait_for_line(arrived)

    def resumed(self) -> None:
        """pdb let the call go on: tell the front end that sent the last command (once)."""
        if self._ended:
            return
        self._ended = True
        self.waiting = False
        text = self._take_written()
        if self._reply_to is not None:
            self._send(self._reply_to, DebugOutput(self.proc_id, self.number, text, True))
        self._on_resumed(self)

    def _take_written(self) -> str:
        text = "".join(self._written)
        self._written.clear()
        if text.endswith(PROMPT):
            text = text[: -len(PROMPT)]
        return text if len(text) <= MAX_OUTPUT_CHARS else "...\n" + text[-MAX_OUTPUT_CHARS:]


class SessionPdb(pdb.Pdb):
    """pdb reading from and writing to a `PausedSession`, blind to the runtime's frames."""

    def __init__(self, session: PausedSession) -> None:
        super().__init__(
            stdin=session,  # type: ignore[arg-type]
            stdout=session,  # type: ignore[arg-type]
            skip=RUNTIME_MODULES,
            nosigint=True,
            readrc=False,
        )
        self.prompt = PROMPT
        self._session = session

    def set_continue(self) -> None:
        super().set_continue()
        if not self.breaks:  # pdb stops tracing: the call runs on, unobserved
            self._session.resumed()

    def set_quit(self) -> None:
        super().set_quit()
        self._session.resumed()

    def dispatch_return(self, frame: FrameType, arg: Any) -> Any:
        """Stepping off the end of the endpoint lets the call go on, untraced, instead of
        stopping in whatever of the runtime's libraries runs next on this thread."""
        result = super().dispatch_return(frame, arg)
        if self._leaves_the_call(frame):
            self.set_continue()
        return result

    def _leaves_the_call(self, frame: FrameType) -> bool:
        """Whether `frame` returning ends the user's code that the runtime called."""
        caller = frame.f_back
        if self._in_runtime(frame) or (caller is not None and not self._in_runtime(caller)):
            return False
        if frame.f_code.co_flags & _SUSPENDABLE:  # an ``await`` that suspends is no end
            return dis.opname[frame.f_code.co_code[frame.f_lasti]] != "YIELD_VALUE"
        return True

    def get_stack(
        self, f: FrameType | None, t: TracebackType | None
    ) -> tuple[list[tuple[FrameType, int]], int]:
        """The stack below the innermost frame of the runtime: the endpoint and what it called."""
        stack, index = super().get_stack(f, t)
        start = index
        while start > 0 and not self._in_runtime(stack[start - 1][0]):
            start -= 1
        if start == 0:  # not called by the runtime (a thread of the user's): all of it
            return stack, index
        return stack[start:], index - start

    def _in_runtime(self, frame: FrameType) -> bool:
        return bool(self.is_skipped_module(frame.f_globals.get("__name__", "")))
