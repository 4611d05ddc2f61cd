"""`AgentWatch`: how a process notices that a host agent running its procs is gone.

A local agent is a child process: its exit is seen at once (a pidfd). A network agent has no
pid to watch: the owner tells it periodically that it lives (`OwnerAlive`) and hears back
(`AgentAlive`); an agent silent for `Settings.agent_timeout_s`, or answering with a new
incarnation (it was restarted), is lost, and every proc it ran is reported "unreachable".
Only silence while this process was there to greet and listen counts: a keep-alive tick that
runs late (this process stopped, or starved of CPU on a busy host) is its own absence.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from mesh._engine.loop import EventLoop
from mesh._engine.messages import AgentAlive, OwnerAlive
from mesh._settings import Settings
from transport import Envelope, Outbox, Payload, get_logger, transport_settings

#: Fails every live proc of an agent (its address, why in words) as "unreachable".
FailProcsOf = Callable[[str, str], None]

#: The longest pause between greetings of a silent agent: greeted less often the longer it is
#: silent (its return stays visible, without a send a tick to a host that is gone for good).
SILENT_GREETING_MAX_S = 10.0

#: A keep-alive tick this much later than planned means this process itself was away.
OWN_PAUSE_S = 0.5

#: An agent's silence is forgiven at most this many agent timeouts in all (until it answers):
#: a process starved on every tick still reports a dead agent.
MAX_FORGIVEN_TIMEOUTS = 5


class AgentHost(Protocol):
    """What watching agents needs of the runtime: the address it hands out and sending."""

    def address_for(self, peer: str | None, home: Any = None) -> str:
        """This process's address to hand to the process at `peer` (`Runtime.address_for`)."""
        ...

    @property
    def outbox(self) -> Outbox: ...

    def send_message(self, address: str, header: Any, payload: Payload | None = None) -> None: ...

    @property
    def closed(self) -> threading.Event: ...

    @property
    def settings(self) -> Settings: ...


class AgentWatch:
    """The agents this process depends on, and whether each is still there."""

    def __init__(
        self, runtime: AgentHost, loop: EventLoop, fail_procs_of: FailProcsOf, proc_id: str
    ) -> None:
        self._runtime = runtime
        self._loop = loop
        self._fail_procs_of = fail_procs_of
        self._attached: set[str] = set()
        self._heard: dict[str, float] = {}
        self.incarnations: dict[str, str] = {}
        self._silent: set[str] = set()  # lost to silence, not heard from since
        self._lost: dict[str, str] = {}  # local agent -> why its process is gone
        self._stopping: set[str] = set()
        self._next_greeting: dict[str, float] = {}  # silent agent -> when to greet it again
        self.greetings: Counter[str] = Counter()  # OwnerAlive messages sent, per agent
        self._greeting = False  # whether the periodic OwnerAlive runs
        self._tick_due: float | None = None  # when the next keep-alive tick is planned
        self._forgiven: dict[str, float] = {}  # agent -> its silence forgiven since it answered
        self._log = get_logger("mesh.runtime", proc=proc_id)

    # -- local agents --------------------------------------------------------------------------

    def watch_agent_process(self, address: str, pid: int) -> None:
        """Report every proc of a local agent as unreachable if that agent process dies."""
        fd = os.pidfd_open(pid)

        def on_exit() -> None:
            self._loop.unwatch_fd(fd)
            os.close(fd)
            stopping = address in self._stopping
            self._lost[address] = f"(pid {pid}) {'was shut down' if stopping else 'died'}"
            if not stopping:
                self._agent_lost(address, self._lost[address])

        self._loop.watch_fd(fd, on_exit)

    def agent_stopping(self, address: str) -> None:
        """The agent at `address` is being shut down on purpose: its exit is no failure."""
        self._stopping.add(address)

    def check_agent(self, agent: str) -> None:
        """Procs were just requested from `agent`: if its process is known to be gone, fail
        them now; if it is silent or being shut down, fail them unless it answers within
        settings.agent_timeout_s (a partition may heal). Either way the request ends."""
        if agent in self._silent:  # greeted now, not after a pause: it may be back
            self._next_greeting.pop(agent, None)
            self._greet(agent)
        doubtful = agent in self._silent or agent in self._stopping
        if doubtful or agent in self._lost:
            self._loop.call_soon_threadsafe(self._check_gone_agent, agent, time.monotonic())

    def _check_gone_agent(self, agent: str, requested_at: float) -> None:
        why = self._lost.get(agent)
        if why is not None:
            self._fail_procs_of(agent, why)
        else:
            self._loop.call_later(
                self._runtime.settings.agent_timeout_s,
                self._fail_if_still_silent,
                agent,
                requested_at,
            )

    def _fail_if_still_silent(self, agent: str, requested_at: float) -> None:
        heard = self._heard.get(agent, requested_at)
        if heard > requested_at:
            return  # it answered since: the request reached it
        if agent in self._stopping:
            self._fail_procs_of(agent, f"at {agent} was shut down by this process")
        elif agent in self._silent:
            self._fail_procs_of(
                agent, f"at {agent} gave no answer for {time.monotonic() - heard:.1f} s"
            )

    # -- network agents ------------------------------------------------------------------------

    def keep_alive(self, agents: list[str]) -> None:
        """Tell these agents, periodically, that this owner lives (they reap our procs if
        it stops: a network owner has no pid they could watch)."""
        new = set(agents) - self._attached
        self._attached |= new
        # Greeted now, from this thread: before any request this thread then sends them (a
        # greeting left to a busy loop thread could come after a spawn), so that their
        # incarnation is known before a restart could hide it.
        for agent in sorted(new):
            self._greet(agent)
        if new and not self._greeting:
            self._greeting = True
            self._loop.call_soon_threadsafe(self._send_owner_alive)

    def is_lost(self, agent: str) -> bool:
        """Whether `agent` is lost: its process died (a local agent), or it is silent (a
        network agent: its host died, or is cut off). One shut down on purpose is not."""
        if agent in self._stopping:
            return False
        return agent in self._silent or agent in self._lost

    def answered(self, agent: str) -> bool:
        """Whether `agent` has answered this process since it was attached."""
        return agent in self.incarnations and agent not in self._silent

    def attached_agents(self) -> list[str]:
        """The network agents this process attached to (and keeps alive)."""
        return sorted(self._attached)

    def _send_owner_alive(self) -> None:
        runtime = self._runtime
        if runtime.closed.is_set():
            return
        now = time.monotonic()
        self._forgive_own_absence(now)
        timeout_s = self._runtime.settings.agent_timeout_s
        for agent in list(self._attached):
            heard = self._heard.setdefault(agent, now)
            if agent in self._stopping and now - heard > timeout_s:
                self._attached.discard(agent)  # gone, as asked: greet it no more
                del self._heard[agent]
                continue
            if self._greets(agent, now, heard):
                self._greet(agent)
            silent = now - heard > timeout_s and agent not in self._stopping
            if silent and agent not in self._silent:  # each silence once
                self._silent.add(agent)
                why = self._refused_by(agent) or f"gave no answer for {now - heard:.1f} s"
                self._agent_lost(agent, f"at {agent} {why}")
        interval_s = self._runtime.settings.owner_alive_interval_s
        self._tick_due = now + interval_s
        self._loop.call_later(interval_s, self._send_owner_alive)

    def _forgive_own_absence(self, now: float) -> None:
        """This tick's lateness is this process's absence, not its agents' silence: no greeting
        went out and no answer was read meanwhile. Each answering agent's silence moves by as
        much; after a real pause it restarts from now (the greeting sent now is its chance), up
        to `MAX_FORGIVEN_TIMEOUTS` in all. Agents already silent or being stopped keep their
        last answer: requests judge by it."""
        late_s = now - (self._tick_due if self._tick_due is not None else now)
        if late_s <= 0:
            return
        most_s = MAX_FORGIVEN_TIMEOUTS * self._runtime.settings.agent_timeout_s
        for agent, heard in self._heard.items():
            if agent in self._silent or agent in self._stopping:
                continue
            moved = now - heard if late_s > OWN_PAUSE_S else min(late_s, now - heard)
            moved = min(moved, most_s - self._forgiven.get(agent, 0.0))
            if moved > 0:
                self._heard[agent] = heard + moved
                self._forgiven[agent] = self._forgiven.get(agent, 0.0) + moved

    def _greet(self, agent: str) -> None:
        self.greetings[agent] += 1
        self._runtime.send_message(agent, OwnerAlive(self._runtime.address_for(agent)))

    def _greets(self, agent: str, now: float, heard: float) -> bool:
        """Whether to greet `agent` this tick: always while it answers; a silent one ever
        less often, the pause growing with its silence up to `SILENT_GREETING_MAX_S`."""
        if agent not in self._silent:
            return True
        if now < self._next_greeting.get(agent, now):
            return False
        self._next_greeting[agent] = now + min(SILENT_GREETING_MAX_S, (now - heard) / 2)
        return True

    def _refused_by(self, agent: str) -> str | None:
        """Why `agent` refuses this process (its CURVE keys), in words, or None."""
        reason = self._runtime.outbox.refusal(agent)
        if reason is None:
            return None
        return (
            f"refused this process: {reason} (wrong or missing CURVE keys: this process uses "
            f"those in {transport_settings().curve_keys}; use the keys of the agent's "
            "allocation, the directory of its --keys, or attach by allocation name)"
        )

    def on_agent_alive(self, envelope: Envelope) -> None:
        header: AgentAlive = envelope.header
        if header.agent not in self._attached:
            return  # not an agent this process keeps alive: nothing to learn
        self._heard[header.agent] = time.monotonic()
        self._forgiven.pop(header.agent, None)
        self._silent.discard(header.agent)
        self._next_greeting.pop(header.agent, None)
        known = self.incarnations.setdefault(header.agent, header.incarnation)
        if known != header.incarnation:
            self.incarnations[header.agent] = header.incarnation
            if header.agent in self._stopping:  # a new agent took the address of one we
                self._stopping.discard(header.agent)  # stopped: watch it like any other
            else:
                self._agent_lost(header.agent, "was restarted, and its procs died with the old one")

    def _agent_lost(self, agent: str, why: str) -> None:
        """Every live proc of `agent` failed with kind "unreachable"."""
        self._log.error("agent_lost", agent=agent, reason=why)
        self._fail_procs_of(agent, why)
