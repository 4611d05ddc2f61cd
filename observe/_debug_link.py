"""`DebugClient`: a debugger front end's link to the procs of some host agents.

It asks each agent for its procs (`ListProcs`), asks each proc for its paused calls
(`DebugQuery`) and sends pdb command lines to one or several of them (`DebugInput`), all over
meshvisor's own channels: ipc in private directories on this host, CURVE-authenticated tcp to
other hosts. Its inbox lives in a private directory of its own. Every wait is bounded, except
that of a pdb command, which runs in the paused call for as long as it takes (as in a local
pdb); an interrupt (Ctrl-C) ends that wait and leaves the call running.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

from mesh.tooling import (
    DebugInput,
    DebugOutput,
    DebugQuery,
    DebugSessions,
    ListProcs,
    PausedCall,
    ProcList,
    invalid_fields,
    write_owner_file,
)
from observe._debug_agents import local_agents
from transport import (
    Envelope,
    Inbox,
    Outbox,
    TransportError,
    close_context,
    encode,
    is_address,
    new_context,
    private_runtime_dir,
)

#: How long agents and procs get to answer a question about what runs and what is paused.
ANSWER_TIMEOUT_S = 10.0


class DebugClient:
    """Finds calls paused in ``breakpoint()`` and drives their pdb (see ``docs/debugger.md``).

    `agents`: the host agents to ask (addresses); None: the local ones of this user's running
    clients. A context manager; `close` removes its socket and private directory.
    """

    def __init__(self, agents: Sequence[str] | None = None, *, listen_host: str = "127.0.0.1"):
        for agent in agents or ():
            if not is_address(agent):
                raise ValueError(
                    f"{agent!r} is not a host agent's address (ipc://PATH or tcp://HOST:PORT)"
                )
        self._dir = private_runtime_dir("meshvisor-debug-")
        write_owner_file(self._dir)  # swept by a later meshvisor process if this one is killed
        self._zmq = new_context()
        self._outbox = Outbox(self._zmq)
        try:
            self._inbox = Inbox(self._zmq, f"ipc://{self._dir}/debug")
        except BaseException:
            self._remove()
            raise
        self._fixed_agents = list(agents) if agents is not None else None
        self.address = self._inbox.address
        if any(agent.startswith("tcp://") for agent in self._fixed_agents or ()):
            try:  # authenticated like every tcp listener: it needs the allocation's keys
                self.address = self._inbox.listen_also(f"tcp://{listen_host}:*")
            except BaseException:
                self.close()
                raise
        self._addresses: dict[str, str] = {}  # proc id -> address, as the agents said
        #: Procs (or agents) that did not answer the last question in time.
        self.silent: list[str] = []
        self._silent_agents: list[str] = []

    def __enter__(self) -> DebugClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the link; paused calls stay paused for the next front end."""
        if not self._zmq.closed:
            self._outbox.close(linger_ms=500)
            self._inbox.close()
        self._remove()

    def _remove(self) -> None:
        if not self._zmq.closed:
            close_context(self._zmq)
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- questions -----------------------------------------------------------------------------

    def paused(self, timeout: float = ANSWER_TIMEOUT_S) -> list[PausedCall]:
        """The calls paused in the debugger now, by actor mesh and rank."""
        self._find_procs(timeout)
        for address in self._addresses.values():
            self._send(address, DebugQuery(self.address))
        waiting = set(self._addresses)
        found: list[PausedCall] = []

        def on_sessions(sessions: DebugSessions) -> None:
            if sessions.proc_id in waiting:
                waiting.discard(sessions.proc_id)
                found.extend(sessions.paused)

        self._receive(DebugSessions, on_sessions, lambda: not waiting, timeout)
        self.silent = [*self._silent_agents, *sorted(waiting)]
        return sorted(found, key=lambda c: (c.actor_mesh, c.rank, c.proc_id, c.session))

    @property
    def agents(self) -> list[str]:
        """The agents asked: those given, or the local ones running now."""
        if self._fixed_agents is not None:
            return self._fixed_agents
        return local_agents(os.path.dirname(self._dir))

    def _find_procs(self, timeout: float) -> None:
        agents = self.agents
        for agent in agents:
            self._send(agent, ListProcs(self.address))
        answered: list[ProcList] = []
        self._receive(ProcList, answered.append, lambda: len(answered) >= len(agents), timeout)
        missing = len(agents) - len(answered)
        self._silent_agents = [f"{missing} of {len(agents)} host agents"] if missing > 0 else []
        self._addresses = {proc_id: address for a in answered for proc_id, address in a.procs}

    # -- commands ------------------------------------------------------------------------------

    def send(self, call: PausedCall, line: str, timeout: float | None = None) -> DebugOutput:
        """Run one pdb command `line` in paused `call`; what pdb printed until it waits again
        (or `resumed`: the call went on). A TimeoutError after `timeout` leaves it running."""
        return self.cast([call], line, timeout)[0]

    def cast(
        self, calls: Sequence[PausedCall], line: str, timeout: float | None = None
    ) -> list[DebugOutput]:
        """Run `line` in each of `calls` at once; their outputs in the same order."""
        keys = [(call.proc_id, call.session) for call in calls]
        for call in calls:
            address = self._addresses.get(call.proc_id)
            if address is None:
                raise ValueError(f"proc {call.proc_id} is not known to this debugger: list again")
            self._send(address, DebugInput(call.session, line, self.address))
        outputs: dict[tuple[str, int], DebugOutput] = {}

        def on_output(output: DebugOutput) -> None:
            key = (output.proc_id, output.session)
            if key in keys:
                outputs[key] = output

        self._receive(DebugOutput, on_output, lambda: len(outputs) == len(set(keys)), timeout)
        missing = [
            f"{proc} session {session}" for proc, session in keys if (proc, session) not in outputs
        ]
        if missing:
            raise TimeoutError(
                f"no answer within {timeout} s from {', '.join(missing)}: the command still "
                "runs there; `list` shows where it stopped"
            )
        return [outputs[key] for key in keys]

    # -- transport -----------------------------------------------------------------------------

    def _send(self, address: str, header: Any) -> None:
        try:
            self._outbox.send(address, encode(header))
        except TransportError as error:
            self.silent.append(f"{address} ({error})")

    def _receive(
        self,
        kind: type,
        handle: Callable[[Any], None],
        done: Callable[[], bool],
        timeout: float | None,
    ) -> None:
        """Hand each valid message of type `kind` to `handle` until `done()` or time is up;
        other messages (late answers to earlier questions) are dropped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            envelope = self._inbox.receive_nowait()
            if envelope is None:
                self._inbox.poll(None if left is None else max(1, int(left * 1000)))
                continue
            if _valid(envelope, kind):
                handle(envelope.header)


def _valid(envelope: Envelope, kind: type) -> bool:
    return type(envelope.header) is kind and invalid_fields(envelope.header) is None
