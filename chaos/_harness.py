"""`run_chaos`: run a workload on a local allocation, inject a schedule of faults, measure how
the job notices and heals each one, check the invariants, and return the report.

The harness is its own process, apart from the workload's client, so that it can kill the
client too. It starts the allocation (one daemon agent per host), starts the client, learns
the targets from it, plans the schedule against them, injects each fault when due and follows
it: the supervision event the owner saw (reported by the client), then the moment the target
answered again. After the last fault it heals everything, lets the workload finish and run its
invariants, and checks that nothing was left behind.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._allocation import LocalAllocation
from ._channel import CHANNEL_FD_ENV, Channel, Message
from ._errors import ChaosSetupError
from ._model import (
    FaultRecord,
    InvariantResult,
    ObservedEvent,
    PlannedFault,
    TargetSet,
)
from ._report import RunReport
from ._schedule import Schedule

#: Whether an expected event is optional ("none" among the expected kinds).
NO_EVENT = "none"
#: How long after a fault ends an event that may or may not come is still waited for.
OPTIONAL_EVENT_GRACE_S = 1.0
#: Event kinds after which the failed process is gone (a healthy answer must come from another).
_DEADLY = frozenset({"signal", "exit", "hung", "unreachable"})


@dataclass
class ChaosOptions:
    """How the harness runs: the allocation, the time limits and what it shows."""

    hosts: int = 2
    #: How long after a fault (and its duration) the owner has to see the event.
    detect_timeout_s: float = 15.0
    #: How long a target gets to answer again after a fault, and everything after the last.
    heal_timeout_s: float = 30.0
    #: How long the workload's client may go without progress before it counts as hung.
    client_hang_s: float = 10.0
    #: Agents reap the procs of a client silent this long (a killed client's procs).
    owner_timeout_s: float = 3.0
    #: A client declares an agent it has not heard from this long unreachable.
    agent_timeout_s: float = 2.0
    #: How long a killed agent or client stays down before the harness starts it again.
    restart_delay_s: float = 0.3
    #: How long the workload has to start and register its targets.
    start_timeout_s: float = 60.0
    #: Modules the agents import before forking procs (e.g. ("torch",): procs start faster).
    preload: tuple[str, ...] = ()
    #: Parameters for the workload, as ``job.params`` (JSON values).
    params: dict[str, Any] = field(default_factory=dict)
    #: Show the output of the workload's processes (clients, agents, procs).
    verbose: bool = False
    #: Called with one line of text for every fault injected, observed and healed.
    on_update: Callable[[str], None] | None = field(default=None, repr=False)


@dataclass
class _Client:
    process: subprocess.Popen[bytes]
    channel: Channel
    generation: int
    log: Path
    ready: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    ready_message: Message = field(default_factory=dict)
    crash: str | None = None


@dataclass
class _Follow:
    """A fault being followed: its record and what it did."""

    record: FaultRecord
    pids: set[int] = field(default_factory=set)
    detected: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


class Harness:
    """One chaos run; see `run_chaos`."""

    def __init__(self, workload: str, schedule: Schedule, options: ChaosOptions) -> None:
        self.workload = workload
        self.schedule = schedule
        self.options = options
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._client: _Client | None = None
        self._follows: list[_Follow] = []
        self._events: list[ObservedEvent] = []
        self._invariants: list[InvariantResult] = []
        self._steps = 0
        self._last_progress: float | None = None
        self._max_gap = 0.0
        self._clients_started = 0
        self._expected_crash = False
        self._orphans_of_killed: set[int] = set()
        self._heartbeat_timeouts: dict[str, float] = {}
        self._done_steps = 0
        self._alloc: LocalAllocation | None = None
        self._records: dict[str, Any] = {}  # what the workload recorded for the report

    # -- the run -----------------------------------------------------------------------------------

    def run(self) -> RunReport:
        started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        wall = time.monotonic()
        with LocalAllocation(
            self.options.hosts,
            owner_timeout_s=self.options.owner_timeout_s,
            preload=self.options.preload,
            verbose=self.options.verbose,
        ) as alloc:
            self._alloc = alloc
            client = self._start_client(0)
            try:
                ready = self._wait_ready(client)
                targets = TargetSet(tuple(ready["meshes"].items()), ready["hosts"], client=True)
                self._heartbeat_timeouts = dict(ready["heartbeat_timeouts"])
                try:
                    plan = self.schedule.plan(targets)
                except ValueError as exc:
                    raise ChaosSetupError(f"the schedule does not fit the workload: {exc}") from exc
                self._t0 = time.monotonic()
                self._last_progress = self._t0
                self._update(f"running {len(plan)} faults over {self._duration():g} s")
                self._inject_all(plan)
                self._final_heal_and_finish()
            except BaseException:
                self._tell_client_to_finish()  # so that it ends (and cleans up) on its own
                raise
            finally:
                self._stop_client()
            builtin = self._check_leftovers(alloc)
        report = RunReport(
            seed=self.schedule.seed,
            replay=self._replay_command(),
            workload=self.workload,
            started_at=started_at,
            wall_s=round(time.monotonic() - wall, 3),
            schedule=self.schedule.to_dict(),
            targets=targets.to_dict(),
            faults=[f.record for f in self._follows],
            events=list(self._events),
            invariants=[*self._builtin_invariants(), *builtin, *self._invariants],
            workload_stats={
                "steps": self._steps,
                "max_step_gap_s": round(self._max_gap, 3),
                "clients": self._clients_started,
                **self._records,
            },
        )
        return report

    def _duration(self) -> float:
        """How long faults are injected: the schedule's duration, or its last fault's time."""
        duration = getattr(self.schedule, "duration_s", None)
        if duration is not None:
            return float(duration)
        return max((p.at_s for p in getattr(self.schedule, "faults", ())), default=0.0)

    def _inject_all(self, plan: list[PlannedFault]) -> None:
        limit = int(getattr(self.schedule, "max_concurrent", 1) or 1)
        for index, planned in enumerate(plan):
            self._sleep_until(planned.at_s)
            while self._active() >= limit:  # the limit on concurrent faults holds at run time
                time.sleep(0.01)
            follow = _Follow(FaultRecord(index, planned, self._expected(planned)))
            with self._lock:
                self._follows.append(follow)
            threading.Thread(target=self._inject_and_follow, args=(follow,), daemon=True).start()
        self._sleep_until(max(self._duration(), plan[-1].at_s if plan else 0.0))
        deadline = time.monotonic() + self.options.heal_timeout_s + self.options.detect_timeout_s
        for follow in self._follows:
            follow.done.wait(max(0.0, deadline - time.monotonic()))

    def _active(self) -> int:
        with self._lock:
            return sum(not f.done.is_set() for f in self._follows)

    def _sleep_until(self, at_s: float) -> None:
        delay = self._t0 + at_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _now_s(self) -> float:
        return round(time.monotonic() - self._t0, 4)

    # -- one fault ---------------------------------------------------------------------------------

    def _inject_and_follow(self, follow: _Follow) -> None:
        record = follow.record
        try:
            self._inject(follow)
        except Exception as exc:
            record.verdict, record.note = "not_injected", f"{type(exc).__name__}: {exc}"
            self._update(f"#{record.index} {record.planned.fault.describe()}: not injected ({exc})")
            follow.done.set()
            return
        self._update(
            f"#{record.index} {record.planned.fault.describe()} on {record.planned.target}"
        )
        try:
            self._follow(follow)
        except Exception as exc:
            record.verdict = "not_healed"
            record.note = f"{type(exc).__name__}: {exc}"
        finally:
            follow.done.set()
        self._update(
            f"#{record.index} {record.verdict}: detected {_ms(record.detect_s)}, "
            f"healthy {_ms(record.recover_s)}"
        )

    def _inject(self, follow: _Follow) -> None:
        record = follow.record
        fault, target = record.planned.fault, record.planned.target
        client = self._require_client()
        if target.level == "rank":
            resolved = client.channel.request(
                "resolve", 10.0, mesh=target.mesh, rank=target.rank, timeout=5.0
            )
            follow.pids = {resolved["pid"]}
        elif target.level == "host":
            follow.pids = {
                pid
                for _, _, pid in client.channel.request("ranks_on", 10.0, host=target.host)
                if pid is not None
            }
        record.injected_at_s = self._now_s()
        pid = next(iter(follow.pids), 0)
        if fault.kind == "kill" and fault.exit_code is not None:
            client.channel.request(
                "exit", 10.0, mesh=target.mesh, rank=target.rank, code=fault.exit_code
            )
        elif fault.kind == "kill":
            os.kill(pid, signal.Signals[fault.signal or "SIGKILL"])
        elif fault.kind == "pause":
            os.kill(pid, signal.SIGSTOP)
        elif fault.kind == "raise":
            client.channel.request(
                "raise",
                10.0,
                mesh=target.mesh,
                rank=target.rank,
                endpoint=fault.endpoint,
                fatal=fault.fatal,
            )
        elif fault.kind in ("drop", "delay"):
            client.channel.request(
                "links",
                10.0,
                mesh=target.mesh,
                rank=target.rank,
                duration_s=fault.duration_s,
                probability=fault.probability,
                delay_s=fault.delay_ms / 1000.0,
                seed=self._fault_seed(record),
            )
        elif fault.kind == "partition":
            client.channel.request(
                "partition",
                10.0,
                host=target.host,
                duration_s=fault.duration_s,
            )
        elif fault.kind == "kill_agent":
            assert self._alloc is not None and target.host is not None
            self._alloc.kill(target.host)
        elif fault.kind == "kill_client":
            assert self._alloc is not None
            self._orphans_of_killed |= self._alloc.procs()
            self._expected_crash = True
            client.process.kill()
            client.process.wait()

    def _follow(self, follow: _Follow) -> None:
        record = follow.record
        fault, target = record.planned.fault, record.planned.target
        injected = self._t0 + (record.injected_at_s or 0.0)
        if fault.kind == "pause":  # a pause seen as a hang heals before the pause ends
            resume = threading.Timer(
                max(0.0, injected + fault.duration_s - time.monotonic()),
                _signal_quietly,
                (follow.pids, signal.SIGCONT),
            )
            resume.start()
            if not follow.detected.wait(max(0.0, injected + fault.duration_s - time.monotonic())):
                resume.join()
        elif fault.kind == "kill_agent":
            _sleep_until_monotonic(injected + self.options.restart_delay_s)
            assert self._alloc is not None and target.host is not None
            self._alloc.start(target.host)
        elif fault.kind == "kill_client":
            _sleep_until_monotonic(injected + self.options.restart_delay_s)
            self._restart_client()
        else:
            _sleep_until_monotonic(injected + fault.duration_s)
        expected = [k for k in record.expected if k != NO_EVENT]
        window_end = injected + fault.duration_s
        if expected and NO_EVENT in record.expected:
            # An optional event can only come while the fault lasts, or just after: probe
            # at once, and again if the event comes after all.
            record.healthy_at_s = self._wait_healthy(follow)
            follow.detected.wait(max(0.0, window_end + OPTIONAL_EVENT_GRACE_S - time.monotonic()))
            if follow.detected.is_set():
                record.healthy_at_s = self._wait_healthy(follow)
        else:
            if expected:
                deadline = window_end + self.options.detect_timeout_s
                follow.detected.wait(max(0.0, deadline - time.monotonic()))
            record.healthy_at_s = self._wait_healthy(follow)
        self._judge_detection(record)
        if record.verdict == "not_injected":
            record.verdict = "ok"

    def _judge_detection(self, record: FaultRecord) -> None:
        expected = [k for k in record.expected if k != NO_EVENT]
        seen = record.observed
        if not expected:
            if seen and NO_EVENT not in record.expected:
                record.verdict = "wrong_kind"
                record.note = f"expected no event, saw {', '.join(seen)}"
            return
        if record.detected_at_s is not None:
            return
        if NO_EVENT in record.expected and not seen:
            return
        record.verdict = "wrong_kind" if seen else "missed"
        record.note = (
            f"expected {' or '.join(expected)}, saw {', '.join(seen)}"
            if seen
            else f"expected {' or '.join(expected)}, saw nothing in "
            f"{self.options.detect_timeout_s:g} s"
        )

    def _wait_healthy(self, follow: _Follow) -> float:
        record = follow.record
        target = record.planned.target
        client = self._require_client()
        timeout = self.options.heal_timeout_s
        if target.level == "client":
            answer = client.channel.request("heal", timeout + 5, timeout=timeout)
        else:
            if target.level == "rank":
                ranks = [[target.mesh, target.rank]]
            else:
                ranks = [
                    [mesh, rank]
                    for mesh, rank, _ in client.channel.request("ranks_on", 10.0, host=target.host)
                ]
            gone = (
                follow.pids
                if set(record.observed) & _DEADLY
                or record.planned.fault.kind in ("kill", "kill_agent")
                else set()
            )
            answer = client.channel.request(
                "wait_healthy",
                timeout + 5,
                ranks=ranks,
                exclude_pids=sorted(gone),
                timeout=timeout,
            )
        healthy = round(float(answer["at"]) - self._t0, 4)
        if record.verdict not in ("missed", "wrong_kind"):
            record.verdict = "ok"
        return healthy

    def _expected(self, planned: PlannedFault) -> tuple[str, ...]:
        """The event kinds that count as the owner noticing `planned` ("none": no event is
        fine too; an empty tuple: no event should come)."""
        fault = planned.fault
        if fault.kind == "kill":
            if fault.exit_code is not None:
                return ("exit",)
            return ("signal",)
        if fault.kind == "pause":
            timeout = self._heartbeat_timeouts.get(planned.target.mesh or "", 2.0)
            return _around(fault.duration_s, timeout, "hung")
        if fault.kind == "raise":
            return ("exception",) if fault.fatal else ()
        if fault.kind == "partition":
            return _around(fault.duration_s, self.options.agent_timeout_s, "unreachable")
        if fault.kind == "kill_agent":
            return ("unreachable",)
        return ()

    def _fault_seed(self, record: FaultRecord) -> int:
        return (self.schedule.seed or 0) * 1_000_003 + record.index

    # -- events from the client --------------------------------------------------------------------

    def _on_event(self, message: Message) -> None:
        at_s = round(message["at"] - self._t0, 4)
        follow = self._attribute(message)
        event = ObservedEvent(
            at_s,
            message["kind"],
            message.get("mesh"),
            message.get("rank"),
            message.get("host"),
            message.get("pid"),
            message.get("message", ""),
            follow.record.index if follow is not None else None,
        )
        with self._lock:
            self._events.append(event)
        if follow is None:
            self._update(f"unexpected event: {event.message}")
            return
        record = follow.record
        record.observed.append(event.kind)
        if event.kind in record.expected and record.detected_at_s is None:
            record.detected_at_s = at_s
            follow.detected.set()

    def _attribute(self, message: Message) -> _Follow | None:
        """The latest fault injected before this event on the process it concerns."""
        pid = message.get("pid")
        at = message["at"] - self._t0
        with self._lock:
            for follow in reversed(self._follows):
                record = follow.record
                if record.injected_at_s is None or record.injected_at_s > at + 0.001:
                    continue
                if pid is not None and pid in follow.pids:
                    return follow
        return None

    def _on_progress(self, message: Message) -> None:
        now = message["at"]
        with self._lock:
            if self._last_progress is not None and not self._expected_crash:
                self._max_gap = max(self._max_gap, now - self._last_progress)
            self._last_progress = now
            self._steps = self._done_steps + message["steps"]

    # -- the client process ------------------------------------------------------------------------

    def _start_client(self, generation: int) -> _Client:
        assert self._alloc is not None
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env[CHANNEL_FD_ENV] = str(theirs.fileno())
        env["MESHVISOR_AGENT_TIMEOUT_S"] = str(self.options.agent_timeout_s)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        output = None if self.options.verbose else subprocess.DEVNULL
        log = self._alloc.directory / f"client{generation}.log"
        errors = None if self.options.verbose else open(log, "wb")  # noqa: SIM115
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "chaos._client",
                self.workload,
                "--agents",
                ",".join(self._alloc.addresses),
                "--generation",
                str(generation),
                "--params",
                json.dumps(self.options.params),
            ],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdout=output,
            stderr=errors,
        )
        theirs.close()
        if errors is not None:
            errors.close()
        holder: list[_Client] = []
        channel = Channel(ours, lambda message: self._on_client_message(holder, message))
        client = _Client(process, channel, generation, log)
        holder.append(client)
        with self._lock:
            self._client = client
            self._clients_started += 1
        return client

    def _on_client_message(self, holder: list[_Client], message: Message) -> None:
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
            self._invariants += [
                InvariantResult(r["name"], bool(r["held"]), r.get("detail", ""))
                for r in message["results"]
            ]
        elif kind == "record":
            with self._lock:
                self._records[message["key"]] = message["value"]
        elif kind == "crashed":
            client.crash = message["error"]
            client.ready.set()
        elif kind in ("done", "closed"):
            client.finished.set()
            client.ready.set()

    def _wait_ready(self, client: _Client) -> Message:
        if not client.ready.wait(self.options.start_timeout_s):
            raise ChaosSetupError(
                f"the workload {self.workload} did not register its targets within "
                f"{self.options.start_timeout_s:g} s (is it calling job.running()?)"
            )
        if not client.ready_message:
            stderr = _stderr_of(client)
            raise ChaosSetupError(
                f"the workload {self.workload} ended before it started running:\n"
                f"{client.crash or stderr}"
            )
        return client.ready_message

    def _restart_client(self) -> None:
        previous = self._require_client()
        previous.channel.close()  # it was killed: nothing more can come
        self._done_steps = self._steps
        client = self._start_client(previous.generation + 1)
        self._wait_ready(client)
        with self._lock:
            self._expected_crash = False
            self._last_progress = time.monotonic()

    def _require_client(self) -> _Client:
        client = self._client
        if client is None:
            raise ChaosSetupError("no workload client is running")
        return client

    def _final_heal_and_finish(self) -> None:
        client = self._require_client()
        timeout = self.options.heal_timeout_s
        try:
            client.channel.request("heal", timeout + 5, timeout=timeout)
            heal = InvariantResult("every target healthy after the final heal", True, "", True)
        except Exception as exc:
            heal = InvariantResult(
                "every target healthy after the final heal", False, str(exc), True
            )
        self._invariants.insert(0, heal)
        try:
            client.channel.request("finish", 10.0)
        except Exception:
            pass
        client.finished.wait(timeout)

    def _tell_client_to_finish(self) -> None:
        client = self._client
        if client is not None and not client.channel.closed:
            try:
                client.channel.request("finish", 5.0)
            except Exception:
                pass  # it is gone already, or cannot answer: _stop_client kills it

    def _stop_client(self) -> None:
        client = self._client
        if client is None:
            return
        try:
            client.process.wait(self.options.heal_timeout_s)
        except subprocess.TimeoutExpired:
            client.process.kill()
            client.process.wait()
        client.channel.close()

    # -- verdicts ------------------------------------------------------------------------------

    def _builtin_invariants(self) -> list[InvariantResult]:
        faults = [f.record for f in self._follows]
        wrong = [r for r in faults if r.verdict != "ok"]
        observed = InvariantResult(
            "every fault observed as expected and healed",
            not wrong,
            "; ".join(
                f"#{r.index} {r.planned.fault.describe()}: {r.verdict} {r.note}".strip()
                for r in wrong
            ),
            True,
        )
        unexpected = [e for e in self._events if e.fault is None]
        stray = InvariantResult(
            "no supervision event without a fault",
            not unexpected,
            "; ".join(e.message for e in unexpected[:5]),
            True,
        )
        client = self._client
        crashed = client is not None and client.crash is not None
        survived = InvariantResult(
            "the client never failed",
            not crashed,
            (client.crash or "").strip().splitlines()[-1] if crashed and client else "",
            True,
        )
        hung = InvariantResult(
            "the client never hung",
            self._max_gap <= self.options.client_hang_s,
            f"longest time without progress: {self._max_gap:.2f} s "
            f"(limit {self.options.client_hang_s:g} s)",
            True,
        )
        return [observed, stray, survived, hung]

    def _check_leftovers(self, alloc: LocalAllocation) -> list[InvariantResult]:
        """After the last client: no proc left on the agents, no socket file left behind."""
        deadline = time.monotonic() + self.options.owner_timeout_s + 10.0
        while alloc.procs() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = alloc.procs() | {p for p in self._orphans_of_killed if _alive(p)}
        sockets = alloc.leftover_sockets()
        return [
            InvariantResult(
                "no orphan process",
                not left,
                f"still running: {sorted(left)}" if left else "",
                True,
            ),
            InvariantResult(
                "no socket file left",
                not sockets,
                ", ".join(p.name for p in sockets),
                True,
            ),
        ]

    def _replay_command(self) -> str:
        args = ["meshvisor", "chaos", "run", self.workload, *self.schedule.replay_args()]
        args += ["--hosts", str(self.options.hosts)]
        return shlex.join(args)

    def _update(self, line: str) -> None:
        if self.options.on_update is not None:
            self.options.on_update(f"[{self._now_s():8.3f}s] {line}")


def run_chaos(
    workload: str | Callable[..., Any],
    schedule: Schedule,
    options: ChaosOptions | None = None,
) -> RunReport:
    """Run `workload` (``file.py:function``, ``module:function`` or an importable function)
    under `schedule` on a fresh local allocation, and return the report."""
    return Harness(workload_reference(workload), schedule, options or ChaosOptions()).run()


def workload_reference(workload: str | Callable[..., Any]) -> str:
    """The ``file.py:function`` a client process can load `workload` from."""
    if isinstance(workload, str):
        return workload
    module = sys.modules.get(workload.__module__)
    path = getattr(module, "__file__", None)
    if path is None or "<locals>" in workload.__qualname__:
        raise ChaosSetupError(
            f"the workload {workload.__qualname__} must be a module-level function of a file "
            "(the client process loads it from there)"
        )
    return f"{path}:{workload.__qualname__}"


def _around(duration_s: float, timeout_s: float, kind: str) -> tuple[str, ...]:
    """A fault that lasts `duration_s` against a detector with `timeout_s`: clearly longer
    must be seen, clearly shorter must not, and in between either is right."""
    if duration_s >= timeout_s + 1.0:
        return (kind,)
    if duration_s <= timeout_s - 0.5:
        return ()
    return (kind, NO_EVENT)


def _sleep_until_monotonic(moment: float) -> None:
    delay = moment - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _signal_quietly(pids: set[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stderr_of(client: _Client) -> str:
    try:
        client.process.wait(5)
        return client.log.read_text(errors="replace")[-4000:]
    except (subprocess.TimeoutExpired, OSError):
        return ""


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
