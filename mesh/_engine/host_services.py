"""`HostServices`: what the actor host needs from its process's runtime, and nothing more.

The host depends on this interface instead of on `Runtime`, so the runtime can own a host
without the two importing each other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from mesh._settings import Settings
from transport import Outbox, Payload, TransportError


class HostServices(Protocol):
    """Sending, scheduling on the event loop, and stopping what an actor owns."""

    @property
    def proc_id(self) -> str: ...

    @property
    def hostname(self) -> str: ...

    @property
    def pid(self) -> int: ...

    @property
    def settings(self) -> Settings:
        """This process's settings, read when used (`mesh.configure` reaches them)."""

    @property
    def agent(self) -> str | None:
        """The address of this proc's host agent (None: a process no agent started)."""

    @property
    def outbox(self) -> Outbox:
        """This process's connections (a sender looks at a connection's handshake)."""

    def send_message(self, address: str, header: Any, payload: Payload | None = None) -> None:
        """Send one message; an unreachable address is logged, never raised."""

    def send_frames(
        self, address: str, kind: type, frames: list[Any], *, soon: bool = False
    ) -> TransportError | None:
        """Send the frames `transport.encode` made for a header of type `kind`; `soon`: they
        may wait a moment in a batch (their receiver waits for more from here anyway). Why
        they could not be sent (logged), or None."""

    def on_loop_thread(self) -> bool:
        """Whether this thread is the event loop's."""

    def call_soon(self, function: Callable[..., Any], *args: Any) -> None:
        """Run `function(*args)` on the loop thread soon, from any thread."""

    def call_later(self, delay_s: float, function: Callable[..., Any], *args: Any) -> None:
        """Run `function(*args)` on the loop thread after `delay_s` (loop thread only)."""

    def start_task(self, function: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start a task on the event loop (loop thread only)."""

    def stop_owned_by(self, actor_id: str, grace_s: float = ...) -> None:
        """Stop every proc that actor `actor_id` spawned (a mesh never outlives its owner)."""
