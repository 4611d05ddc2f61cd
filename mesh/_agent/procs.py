"""The host agent's table of procs: what it knows of each proc it started, by id and by pid,
and the exit reports it keeps for watchers that ask after a proc is gone."""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from mesh._agent.liveness import CpuSample
from mesh._agent.oom_kills import CgroupMemory
from mesh._agent.spawning import bootstrap_failure
from mesh._engine.messages import ProcExited, ProcSpec, SpawnProcs
from mesh._engine.view_messages import ActorView

#: Exit reports kept for watchers that ask about a proc after it is gone.
_EXITED_MEMORY = 10_000
#: Procs that ended kept for the live view (with their actors and exit reports).
_ENDED_MEMORY = 100
#: Extra time a new proc gets for its first heartbeat (imports, user __init__ of the runtime).
_STARTUP_GRACE_S = 10.0


@dataclass
class ProcRecord:
    """One proc of this agent, from the spawn request to its exit: where it listens, who owns
    and watches it, whether it was asked to stop, and its heartbeat deadlines."""

    spec: ProcSpec
    owner: str
    address: str
    heartbeat_timeout_s: float
    busy_timeout_s: float
    pid: int | None = None
    stop_requested: bool = False
    stop_why: str = ""  # what its owner said when it stopped it (`StopProcs.why`)
    hung: bool = False
    why_hung: str = ""
    kill_at: float | None = None
    failure: str | None = None  # why it could not start, as it said before exiting
    heartbeat_due: float = 0.0
    silent_since: float = 0.0  # the last heartbeat (or the spawn)
    forgiven_s: float = 0.0  # how far the agent's pauses moved its deadline since then
    cpu: CpuSample | None = None  # sampled with the last heartbeat, or the last check
    cpu_at: float = 0.0
    owned_by_proc: set[str] = field(default_factory=set)
    watchers: set[str] = field(default_factory=set)
    bootstrap: tuple[str, ...] = ()  # the command that starts it (`SpawnProcs.bootstrap`)
    connected: bool = False  # it said it is ready
    memory: CgroupMemory | None = None  # its memory cgroup, sampled when it was ready
    dump_requested_at: float = 0.0  # when the agent asked a hung proc for its stacks
    # what the live view shows (mesh/_agent/snapshots.py)
    restarts: int = 0  # how many procs before it it replaces, in a chain of re-spawns
    started: float = field(default_factory=time.time)
    ended: float | None = None
    report: ProcExited | None = None
    actors: tuple[ActorView, ...] = ()
    detached: str = ""  # the detached mesh it belongs to: kept when its owner goes away

    @classmethod
    def requested(cls, request: SpawnProcs, spec: ProcSpec, address: str) -> ProcRecord:
        """The record of proc `spec` of spawn `request`, to listen at `address`: not forked
        yet."""
        timeouts = (request.heartbeat_timeout_s, request.busy_timeout_s)
        proc = cls(spec, request.owner, address, *timeouts)
        proc.bootstrap = request.bootstrap
        proc.expect_first_heartbeat()
        return proc

    @property
    def proc_id(self) -> str:
        return self.spec.proc_id

    def note_exit_before_connecting(self, code: int, signame: str | None) -> None:
        """A launched proc that ends before it connected failed to start: say which command."""
        if self.bootstrap and not self.connected and self.failure is None:
            self.failure = bootstrap_failure(self.bootstrap, code, signame, self.hung)

    def expect_first_heartbeat(self) -> None:
        """Start the heartbeat clock of a new proc (requested, then again once forked): it
        gets a start-up grace."""
        self.silent_since = time.monotonic() + _STARTUP_GRACE_S
        self.heartbeat_due = self.silent_since + self.heartbeat_timeout_s
        self.forgiven_s = 0.0


class ProcTable:
    """The procs this agent runs (by id, and by pid once forked) and the last exit reports."""

    def __init__(self) -> None:
        self._running: dict[str, ProcRecord] = {}
        self._by_pid: dict[int, str] = {}
        self._exited: dict[str, ProcExited] = {}
        self._exited_watchers: dict[str, set[str]] = {}  # for a re-spawn to take over
        self.ended: deque[ProcRecord] = deque(maxlen=_ENDED_MEMORY)  # the latest last
        #: proc id -> (detached mesh, rank), for procs running or gone; a re-spawn takes over.
        self.detached: dict[str, tuple[str, int]] = {}

    def __len__(self) -> int:
        return len(self._running)

    def __contains__(self, proc_id: str) -> bool:
        return proc_id in self._running

    def __iter__(self) -> Iterator[ProcRecord]:
        """The running procs, as a snapshot: the loop body may add or remove procs."""
        return iter(list(self._running.values()))

    def ids(self) -> tuple[str, ...]:
        return tuple(self._running)

    def get(self, proc_id: str) -> ProcRecord | None:
        return self._running.get(proc_id)

    def note_stop_why(self, proc_ids: tuple[str, ...], why: str) -> None:
        """What the owner said when it stopped these procs, for the first stop of each."""
        for proc_id in proc_ids:
            proc = self._running.get(proc_id)
            if proc is not None and not proc.stop_requested and why:
                proc.stop_why = why

    def add(self, proc: ProcRecord) -> None:
        """Add a proc about to be forked: it inherits the watchers of the proc it replaces,
        and it is owned by the proc (if any) that asked for it, to stop with it."""
        proc.watchers = self._exited_watchers.pop(proc.spec.replaces, set())
        if proc.spec.replaces:
            replaced = next((p for p in self.ended if p.proc_id == proc.spec.replaces), None)
            proc.restarts = 1 + (replaced.restarts if replaced is not None else 0)
        mesh = self.detached.pop(proc.spec.replaces, None) or self.detached.get(proc.proc_id)
        if mesh is not None:
            self.detached[proc.proc_id] = mesh
            proc.detached = mesh[0]
        self._running[proc.proc_id] = proc
        for other in self._running.values():
            if other.address == proc.owner:
                other.owned_by_proc.add(proc.proc_id)

    def discard(self, proc_id: str) -> ProcRecord | None:
        """Forget a proc that was never forked (the fork server could not start it)."""
        return self._running.pop(proc_id, None)

    def bind_pid(self, proc: ProcRecord, pid: int) -> None:
        proc.pid = pid
        self._by_pid[pid] = proc.proc_id

    def pop_exited(self, pid: int) -> ProcRecord | None:
        """Remove the proc whose process `pid` exited; None if it was not one of ours."""
        proc_id = self._by_pid.pop(pid, None)
        proc = self._running.pop(proc_id, None) if proc_id else None
        if proc is not None:
            proc.ended = time.time()
            self.ended.append(proc)
        return proc

    def owned_by(self, owner: str) -> tuple[str, ...]:
        """The procs that `owner` spawned here, but for those of detached meshes."""
        return tuple(
            p.proc_id for p in self._running.values() if p.owner == owner and not p.detached
        )

    def ids_by_owner(self) -> dict[str, tuple[str, ...]]:
        """The running procs' ids, by owner."""
        by_owner: dict[str, tuple[str, ...]] = {}
        for proc in self._running.values():
            by_owner[proc.owner] = (*by_owner.get(proc.owner, ()), proc.proc_id)
        return by_owner

    def exit_report(self, proc_id: str) -> ProcExited | None:
        """The remembered exit report of a proc that is gone, if any."""
        return self._exited.get(proc_id)

    def remember(self, report: ProcExited, watchers: set[str]) -> None:
        """Keep the exit report (and the watchers, for a re-spawn to take over), the oldest
        forgotten beyond a bounded memory."""
        self._exited[report.proc_id] = report
        ended = next((p for p in reversed(self.ended) if p.proc_id == report.proc_id), None)
        if ended is not None:
            ended.report = report
        if watchers:
            self._exited_watchers[report.proc_id] = watchers
        if len(self._exited) > _EXITED_MEMORY:
            oldest = next(iter(self._exited))
            del self._exited[oldest]
            self._exited_watchers.pop(oldest, None)


def exit_code_and_signal(status: int) -> tuple[int, str | None]:
    """The exit code of a `waitpid` status (negative for a signal) and the signal's name."""
    code = os.waitstatus_to_exitcode(status)
    return code, signal_name(-code) if code < 0 else None


def signal_name(signum: int) -> str:
    """The name of signal `signum`: ``SIGKILL``, or ``SIGRTMIN+8`` for a real-time one."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        if hasattr(signal, "SIGRTMIN") and signal.SIGRTMIN < signum < signal.SIGRTMAX:
            return f"SIGRTMIN+{signum - signal.SIGRTMIN}"
        return f"signal {signum}"


def exit_report(
    proc: ProcRecord,
    pid: int,
    code: int,
    signame: str | None,
    hostname: str,
    evidence: tuple[str, str] = ("", ""),
) -> ProcExited:
    """What the owner and watchers of `proc` learn when its process `pid` exited with `code`
    (negative: killed by signal `signame`); `evidence`: the stacks it dumped and why it ran
    out of memory (`evidence.take_evidence`)."""
    return ProcExited(
        proc.proc_id,
        pid,
        hostname,
        None if code < 0 else code,
        signame,
        proc.stop_requested and not proc.hung,
        proc.hung,
        proc.why_hung,
        *evidence,
        why_stopped=proc.stop_why,
    )


def unknown_proc_report(proc_id: str, hostname: str) -> ProcExited:
    """The report for a proc this agent never ran (it ran under a previous agent)."""
    return ProcExited(proc_id, 0, hostname, None, None, requested=True)
