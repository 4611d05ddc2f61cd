"""`PausedCalls`: ``breakpoint()`` in a proc pauses that call in pdb, served to debugger
front ends over the proc's inbox (no socket of its own: ipc in a private directory, or the
proc's CURVE-authenticated tcp).

The hook (`breakpoint`) starts a `PausedSession` for the calling thread; pdb reads its commands
from `DebugInput` messages and its output goes back as `DebugOutput` to whoever sent the
command. Only the thread that called ``breakpoint()`` waits: other actors of the proc, other
ranks and the heartbeat thread go on (a wait releases the GIL), so the agent never takes a
paused proc for a hung one. A paused call on the loop thread (an async endpoint) pumps the
proc's inbox while it waits, as a blocking ``get()`` there does. ``MESHVISOR_DEBUG=0`` turns
``breakpoint()`` into a logged no-op; a ``PYTHONBREAKPOINT`` of the user's own is left alone.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from mesh._context import context
from mesh._engine.callwatch import resume_call_watchdog, suspend_call_watchdog
from mesh._engine.debug_messages import (
    MAX_LINE_CHARS,
    DebugInput,
    DebugOutput,
    DebugQuery,
    DebugSessions,
)
from mesh._engine.future import Future
from mesh._engine.messages import invalid_fields
from transport import Envelope, get_logger, is_address

if TYPE_CHECKING:
    from mesh._engine.debug_session import PausedSession

#: Set to "0" (or "false", "no", "off") in a proc's environment: ``breakpoint()`` does nothing.
ENABLE_ENV = "MESHVISOR_DEBUG"
_OFF = ("0", "false", "no", "off")


class DebugHost(Protocol):
    """What paused calls need of their process's runtime."""

    proc_id: str
    hostname: str

    def send_message(self, address: str, header: Any) -> None: ...
    def on_loop_thread(self) -> bool: ...
    def pump_until(self, future: Future[Any], timeout: float | None) -> None: ...


def debugging_enabled() -> bool:
    """Whether ``breakpoint()`` pauses calls in this proc (``MESHVISOR_DEBUG`` is not off)."""
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in _OFF


class PausedCalls:
    """The calls of this process paused in pdb, by session number."""

    def __init__(self, host: DebugHost) -> None:
        self._host = host
        self._sessions: dict[int, PausedSession] = {}
        self._numbers = itertools.count(1)
        self._by_thread = threading.local()
        self._lock = threading.Lock()
        self._log = get_logger("mesh.debugger", proc=host.proc_id)
        self._warned = False

    def message_handlers(self) -> dict[type, Callable[[Envelope], None]]:
        """The runtime's table entries for the debugger's messages."""
        return {DebugQuery: self._on_query, DebugInput: self._on_input}

    def install(self) -> None:
        """Make ``breakpoint()`` in this process pause in pdb (unless the user set
        ``PYTHONBREAKPOINT``, which Python's own hook follows)."""
        if not os.environ.get("PYTHONBREAKPOINT"):
            sys.breakpointhook = self.breakpoint

    # -- the paused thread ---------------------------------------------------------------------

    def breakpoint(self, *args: Any, **kwargs: Any) -> None:
        """``sys.breakpointhook``: pause the calling thread in pdb, at its caller's next line."""
        frame = sys._getframe(1)
        if not debugging_enabled():
            self._ignore(frame)
            return
        session: PausedSession | None = getattr(self._by_thread, "session", None)
        if session is None:
            session = self._start(frame)
        session.debugger.set_trace(frame)

    def _start(self, frame: FrameType) -> PausedSession:
        # pdb (and what it imports) loads with a proc's first breakpoint, not with every proc
        from mesh._engine.debug_session import PausedSession

        running = context()
        number = next(self._numbers)
        session = PausedSession(
            number,
            frame,
            wait_for_line=self._wait_for,
            send=self._host.send_message,
            on_resumed=self._leave_pause,
        )
        session.describe(
            proc_id=self._host.proc_id,
            actor_id=running.actor_id or "",
            mesh_name=running.mesh_name or "",
            point=_point_text(dict(running.rank)),
            host=self._host.hostname,
        )
        self._enter_pause(session)
        where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        print(
            f"meshvisor: {session.describe_short()} paused at {where} (breakpoint); debug it "
            "with `meshvisor debug` in another terminal, or observe.debug() in the client",
            file=sys.stderr,
            flush=True,
        )
        return session

    def _wait_for(self, future: Future[Any]) -> None:
        """Wait for a command on this thread: pumping the inbox if this is the loop thread."""
        if self._host.on_loop_thread():
            self._host.pump_until(future, None)
        else:
            future.wait_briefly(None)

    # -- the one place where a call enters and leaves the debugger -----------------------------

    def _enter_pause(self, session: PausedSession) -> None:
        """A call is paused in the debugger from here until `_leave_pause` (both on the paused
        thread): the call watchdog does not judge this thread's calls meanwhile, nor count
        the time paused against their limits."""
        suspend_call_watchdog()
        with self._lock:
            self._sessions[session.number] = session
        self._by_thread.session = session
        self._log.info("call_paused", session=session.number, actor=session.actor_id)

    def _leave_pause(self, session: PausedSession) -> None:
        """The call goes on (continue, or quit): it is no longer paused in the debugger."""
        with self._lock:
            paused = self._sessions.pop(session.number, None) is not None
        if paused:
            resume_call_watchdog()
        if getattr(self._by_thread, "session", None) is session:
            self._by_thread.session = None
        self._log.info("call_resumed", session=session.number, actor=session.actor_id)

    # -- messages (loop thread) ----------------------------------------------------------------

    def _on_query(self, envelope: Envelope) -> None:
        if not self._well_formed(envelope.header):
            return
        with self._lock:
            sessions = list(self._sessions.values())
        paused = tuple(s.paused_call() for s in sessions if s.waiting)
        self._host.send_message(envelope.header.reply_to, DebugSessions(self._host.proc_id, paused))

    def _on_input(self, envelope: Envelope) -> None:
        header: DebugInput = envelope.header
        if not self._well_formed(header):
            return
        with self._lock:
            session = self._sessions.get(header.session)
        reason = _bad_line(header.line)
        if session is None or reason is not None:
            why = reason or (
                f"no call of proc {self._host.proc_id} is paused as session {header.session} "
                "(it went on, or its proc was restarted); `list` shows those paused now"
            )
            gone = DebugOutput(self._host.proc_id, header.session, why, session is None)
            self._host.send_message(header.reply_to, gone)
            return
        session.give(header.line, header.reply_to)

    def _well_formed(self, header: Any) -> bool:
        """Whether `header` holds the types it declares (a peer may send anything); a bad one
        is logged and dropped, never handed to pdb."""
        reason = invalid_fields(header) or _bad_address(header.reply_to)
        if reason is not None:
            self._log.warning("debugger_message_dropped", kind=type(header).__name__, reason=reason)
        return reason is None

    def _ignore(self, frame: FrameType) -> None:
        """``breakpoint()`` with debugging off: say so once per process, then go on."""
        if not self._warned:
            self._warned = True
            self._log.warning(
                "breakpoint_ignored",
                where=f"{frame.f_code.co_filename}:{frame.f_lineno}",
                reason=f"{ENABLE_ENV} is off in this proc; breakpoint() does nothing",
            )


def _bad_line(line: str) -> str | None:
    """Why a pdb command line cannot be given to pdb, or None."""
    if len(line) > MAX_LINE_CHARS or "\0" in line or "\n" in line or "\r" in line:
        return (
            f"a debugger command must be one line of at most {MAX_LINE_CHARS} characters "
            "without NUL characters; it was not run"
        )
    return None


def _bad_address(address: str) -> str | None:
    return None if is_address(address) else f"reply_to {address[:60]!r} is not an address"


def _point_text(coords: dict[str, int]) -> str:
    return "{" + ", ".join(f"{label}={index}" for label, index in coords.items()) + "}"
