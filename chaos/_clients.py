"""The harness's side of the workload's client process: start it, hear what it reports, ask it
to carry out operations, restart it after a "kill_client" fault, and stop it at the end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._allocation import Allocation
from ._channel import CHANNEL_FD_ENV, Channel, Message
from ._errors import ChaosSetupError
from ._model import InvariantResult
from ._options import ChaosOptions

#: The name of the invariant checked by the final heal.
FINAL_HEAL = "every target healthy after the final heal"


@dataclass
class ClientProcess:
    """One workload client process and the channel to it."""

    process: subprocess.Popen[bytes]
    channel: Channel
    generation: int
    log: Path
    ready: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    ready_message: Message = field(default_factory=dict)
    crash: str | None = None

    def stderr(self) -> str:
        """The end of what the process wrote to stderr, once it ended ("" if unknown)."""
        try:
            self.process.wait(5)
            return self.log.read_text(errors="replace")[-4000:]
        except (subprocess.TimeoutExpired, OSError):
            return ""


class Clients:
    """The run's workload clients: the current one, and what all of them reported."""

    def __init__(
        self,
        workload: str,
        options: ChaosOptions,
        alloc: Allocation,
        on_event: Callable[[Message], None],
    ) -> None:
        self.workload = workload
        self.options = options
        self.alloc = alloc
        self._on_event = on_event
        self._lock = threading.Lock()
        self.current: ClientProcess | None = None
        self.started = 0
        self.steps = 0
        self.max_gap = 0.0
        self.invariants: list[InvariantResult] = []
        self.records: dict[str, Any] = {}  # what the workload recorded for the report
        self.orphans_of_killed: set[int] = set()
        self._done_steps = 0
        self._last_progress: float | None = None
        self._expected_crash = False

    def require(self) -> ClientProcess:
        """The current client; ChaosSetupError when none runs."""
        client = self.current
        if client is None:
            raise ChaosSetupError("no workload client is running")
        return client

    def request(self, op: str, wait_s: float, **args: Any) -> Any:
        """Ask the current client to carry out `op` (waiting at most `wait_s`)."""
        return self.require().channel.request(op, wait_s, **args)

    def start(self, generation: int) -> ClientProcess:
        """Start client number `generation` of the run."""
        ours, theirs = socket.socketpair()
        log = self.alloc.directory / f"client{generation}.log"
        errors = None if self.options.verbose else open(log, "wb")  # noqa: SIM115
        process = subprocess.Popen(
            self._command(generation),
            pass_fds=(theirs.fileno(),),
            env=self._environment(theirs.fileno()),
            stdout=None if self.options.verbose else subprocess.DEVNULL,
            stderr=errors,
        )
        theirs.close()
        if errors is not None:
            errors.close()
        holder: list[ClientProcess] = []
        channel = Channel(ours, lambda message: self._on_message(holder, message))
        client = ClientProcess(process, channel, generation, log)
        holder.append(client)
        with self._lock:
            self.current = client
            self.started += 1
        return client

    def _command(self, generation: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "chaos._client",
            self.workload,
            "--agents",
            ",".join(self.alloc.addresses),
            "--generation",
            str(generation),
            "--params",
            json.dumps(self.options.params),
        ]

    def _environment(self, channel_fd: int) -> dict[str, str]:
        env = dict(os.environ)
        env[CHANNEL_FD_ENV] = str(channel_fd)
        env["MESHVISOR_AGENT_TIMEOUT_S"] = str(self.options.agent_timeout_s)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        return env

    def wait_ready(self, client: ClientProcess) -> Message:
        """The client's "ready" message (its targets); ChaosSetupError if it never came."""
        if not client.ready.wait(self.options.start_timeout_s):
            raise ChaosSetupError(
                f"the workload {self.workload} did not register its targets within "
                f"{self.options.start_timeout_s:g} s (is it calling job.running()?)"
            )
        if not client.ready_message:
            raise ChaosSetupError(
                f"the workload {self.workload} ended before it started running:\n"
                f"{client.crash or client.stderr()}"
            )
        return client.ready_message

    def start_progress_clock(self) -> None:
        """Measure gaps in the current client's progress from its first report on (it comes
        with its first step, possibly before this runs on a busy machine: a stall right after
        that step counts whole), not from the end of a killed client's."""
        with self._lock:
            self._expected_crash = False

    def kill(self) -> None:
        """Kill the current client (a fault): its procs are orphans, and must be reaped."""
        client = self.require()
        self.orphans_of_killed |= self.alloc.procs()
        self._expected_crash = True
        client.process.kill()
        client.process.wait()

    def restart(self) -> None:
        """Start the next client after a killed one, and wait until it is ready."""
        previous = self.require()
        previous.channel.close()  # it was killed: nothing more can come
        with self._lock:
            self._last_progress = None  # its successor's startup is no gap in the workload
        self._done_steps = self.steps
        self.wait_ready(self.start(previous.generation + 1))
        self.start_progress_clock()

    def final_heal_and_finish(self) -> None:
        """Heal every target (an invariant), then let the workload finish."""
        client = self.require()
        timeout = self.options.heal_timeout_s
        try:
            client.channel.request("heal", timeout + 5, timeout=timeout)
            heal = InvariantResult(FINAL_HEAL, True, "", True)
        except Exception as exc:
            heal = InvariantResult(FINAL_HEAL, False, str(exc), True)
        self.invariants.insert(0, heal)
        try:
            client.channel.request("finish", 10.0)
        except Exception:
            pass
        client.finished.wait(timeout)

    def tell_to_finish(self) -> None:
        """Ask the current client to end (and clean up) on its own."""
        client = self.current
        if client is not None and not client.channel.closed:
            try:
                client.channel.request("finish", 5.0)
            except Exception:
                pass  # it is gone already, or cannot answer: stop() kills it

    def stop(self) -> None:
        """Wait for the current client to end, killing it after the heal timeout."""
        client = self.current
        if client is None:
            return
        try:
            client.process.wait(self.options.heal_timeout_s)
        except subprocess.TimeoutExpired:
            client.process.kill()
            client.process.wait()
        client.channel.close()

    def _on_message(self, holder: list[ClientProcess], message: Message) -> None:
        while not holder:  # the reader may deliver before the constructor returned
            time.sleep(0.001)
        client = holder[0]
        kind = message["type"]
        if kind == "event":
            self._on_event(message)
        elif kind == "progress":
            self._on_progress(message)
        elif kind == "ready":
            client.ready_message = message
            client.ready.set()
        elif kind == "invariants":
            self.invariants += [
                InvariantResult(r["name"], bool(r["held"]), r.get("detail", ""))
                for r in message["results"]
            ]
        elif kind == "record":
            with self._lock:
                self.records[message["key"]] = message["value"]
        elif kind == "crashed":
            client.crash = message["error"]
            client.ready.set()
        elif kind in ("done", "closed"):
            client.finished.set()
            client.ready.set()

    def _on_progress(self, message: Message) -> None:
        now = message["at"]
        with self._lock:
            if self._last_progress is not None and not self._expected_crash:
                self.max_gap = max(self.max_gap, now - self._last_progress)
            self._last_progress = now
            self.steps = self._done_steps + message["steps"]
