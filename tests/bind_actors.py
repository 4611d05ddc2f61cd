"""Actors for tests/test_reader_calls.py (importable by procs): each asks its proc to listen
on tcp from a different thread, and says which thread bound the inbox."""

from __future__ import annotations

import threading

import anyio

from mesh import Actor, Channel, endpoint, testing

#: Set by `Binder.release`: ends `Blocker.hold`.
_RELEASE = threading.Event()
#: Set once `Blocker.hold` runs: the thread that received the call is blocked from then on.
_HOLDING = threading.Event()


class Binder(Actor):
    """Asks its proc to listen on tcp; answers (tcp address, the binding thread, whether no
    other thread read the inbox meanwhile, the asking thread)."""

    @endpoint
    def bind_here(self, bind: bool) -> tuple[str, int | None, bool, int]:
        """From the thread that runs this sync call: the receiver when the call came alone,
        of a route seen before (a lone call: `bind` False first), to this idle actor."""
        if not bind:
            return "", None, True, threading.get_ident()
        return (*testing.listen_on_tcp(), threading.get_ident())

    @endpoint
    async def bind_off_reader(self) -> tuple[str, int | None, bool, int]:
        """From a thread that does not read the inbox, while the receiver waits on it."""
        asker: list[int] = []

        def ask() -> tuple[str, int | None, bool]:
            asker.append(threading.get_ident())
            return testing.listen_on_tcp()

        return (*await anyio.to_thread.run_sync(ask), asker[0])

    @endpoint
    async def wait_holding(self, limit: float) -> bool:
        return await anyio.to_thread.run_sync(_HOLDING.wait, limit)

    @endpoint
    async def release(self) -> None:
        _RELEASE.set()

    @endpoint
    def open_port(self) -> int:
        """A port of this proc: its id (a raw peer sends to it: `wire.PortMessage`)."""
        port, self._values = Channel[str].open()
        return port._port_id

    @endpoint
    async def next_value(self) -> str:
        return await self._values.recv()


class Blocker(Actor):
    """Blocks the thread that received its call (until `Binder.release`)."""

    @endpoint
    def hold(self, limit: float) -> int:
        _HOLDING.set()
        _RELEASE.wait(limit)
        return threading.get_ident()
