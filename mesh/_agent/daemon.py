"""The host agent: spawns procs on one host, watches them, stops them, reports to owners.

Run as ``python -m mesh._agent``. It forks its fork server before anything else (so the server
stays single-threaded), then serves requests on its inbox. Proc exits are known the moment the
fork server reaps them. When the agent's owner goes away, every proc it started is stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import selectors
import shutil
import signal
import socket
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Imported before the fork server is forked, so procs start with them loaded.
from mesh._agent import proc_main  # noqa: F401
from mesh._agent.forkserver import PRELOAD_ENV, ForkServerClient, start_forkserver
from mesh._agent.liveness import CpuSample, progressed, sample_cpu
from mesh._engine.fault_rules import apply_fault_rules
from mesh._engine.messages import (
    AgentAlive,
    Heartbeat,
    OwnerAlive,
    ProcExited,
    ProcReady,
    ProcReplaced,
    ProcSpec,
    SetFaultRules,
    ShutdownAgent,
    SpawnFailed,
    SpawnProcs,
    StopProc,
    StopProcs,
    WatchProcs,
    invalid_request,
    refusable_spawn,
)
from mesh._settings import reload_settings
from transport import (
    KEYS_ENV,
    CurveKeys,
    Envelope,
    TransportError,
    check_exposure,
    close_context,
    configured_keys,
    private_runtime_dir,
    raise_open_file_limit,
    transport_settings,
    use_curve_keys,
)

DEFAULT_GRACE_S = 5.0


#: Exit reports kept for watchers that ask about a proc after it is gone.
_EXITED_MEMORY = 10_000
#: Extra time a new proc gets for its first heartbeat (imports, user __init__ of the runtime).
_STARTUP_GRACE_S = 10.0
#: A serve loop this much later than it planned means the agent itself was paused.
_PAUSE_S = 0.5


@dataclass
class _Proc:
    spec: ProcSpec
    owner: str
    address: str
    heartbeat_timeout_s: float
    busy_timeout_s: float
    pid: int | None = None
    stop_requested: bool = False
    hung: bool = False
    why_hung: str = ""
    kill_at: float | None = None
    failure: str | None = None  # why it could not start, as it said before exiting
    heartbeat_due: float = 0.0
    silent_since: float = 0.0  # the last heartbeat (or the spawn)
    cpu: CpuSample | None = None  # sampled with the last heartbeat, or the last check
    cpu_at: float = 0.0
    owned_by_proc: set[str] = field(default_factory=set)
    watchers: set[str] = field(default_factory=set)


class HostAgent:
    """Serves one host: spawn, watch, stop, report."""

    def __init__(
        self,
        forkserver: ForkServerClient,
        address: str,
        rundir: str,
        owner_pid: int | None,
        orphan_timeout_s: float = 0.0,
        owner_timeout_s: float = 3.0,
        parent_pid: int | None = None,
    ) -> None:
        from transport import Inbox, Outbox, get_logger, new_context

        self._forkserver = forkserver
        self._rundir = rundir
        self._zmq = new_context()
        self._inbox = Inbox(self._zmq, address)
        self._outbox = Outbox(self._zmq)
        self._hostname = socket.gethostname()
        self._procs: dict[str, _Proc] = {}
        self._by_pid: dict[int, str] = {}
        self._exited: dict[str, ProcExited] = {}
        self._exited_watchers: dict[str, set[str]] = {}  # for a re-spawn to take over
        watched = owner_pid or parent_pid  # when it exits, everything stops
        self._owner_fd = os.pidfd_open(watched) if watched else None
        self._shutting_down = False
        self._orphan_timeout_s = orphan_timeout_s
        self._owner_timeout_s = owner_timeout_s
        self._owners_seen: dict[str, float] = {}
        self._shutdown_requested = False
        self.address = self._inbox.address
        self.owner_died = False
        self._incarnation = f"{os.getpid()}-{time.time_ns()}"
        self._last_check = time.monotonic()
        self._log = get_logger("mesh.agent", address=address)
        if owner_pid is None:  # a daemon: the run directory is its own
            _remove_stale_sockets(rundir, keep=self.address)

    def serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._inbox.fileno(), selectors.EVENT_READ, "inbox")
        selector.register(self._forkserver.socket, selectors.EVENT_READ, "forkserver")
        if self._owner_fd is not None:
            selector.register(self._owner_fd, selectors.EVENT_READ, "owner")
        refusals = self._inbox.watch_refusals() if configured_keys() is not None else None
        if refusals is not None:
            selector.register(refusals.fileno(), selectors.EVENT_READ, "refusals")
        self._log.info("agent_started", pid=os.getpid())
        self._last_check = time.monotonic()
        while True:
            self._drain_inbox()
            if refusals is not None:  # edge-triggered like the inbox: drain every time
                refusals.drain()
            if self._shutdown_requested and not self._shutting_down:
                self._shutdown(DEFAULT_GRACE_S)
            if self._shutting_down and not self._procs:
                break
            self._watch_forkserver(selector)
            wait_s = self._next_timeout()
            for key, mask in selector.select(wait_s):
                if key.data == "forkserver":
                    if mask & selectors.EVENT_WRITE:
                        self._forkserver.flush()
                    if mask & selectors.EVENT_READ:
                        self._drain_forkserver()
                elif key.data == "refusals" and refusals is not None:
                    refusals.drain()
                elif key.data == "owner":
                    self._log.warning("owner_gone", reason="the client process exited")
                    selector.unregister(key.fd)
                    self.owner_died = True
                    self._shutdown(grace_s=self._orphan_timeout_s)
            self._drain_inbox()  # heartbeats that queued while it waited count first
            self._forgive_absence(wait_s)
            self._enforce_deadlines()
            if self._shutting_down and not self._procs:
                break
        if refusals is not None:
            refusals.close()
        self._close()

    def _watch_forkserver(self, selector: selectors.BaseSelector) -> None:
        """Read the fork server's reports; also wait for room to send while requests queue."""
        events = selectors.EVENT_READ
        if self._forkserver.pending:
            events |= selectors.EVENT_WRITE
        selector.modify(self._forkserver.socket, events, "forkserver")

    # -- requests ------------------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        while (envelope := self._inbox.receive_nowait()) is not None:
            reason = invalid_request(envelope.header)
            if reason is not None:
                self._reject(envelope.header, reason)
                continue
            try:
                self._handle(envelope)
            except Exception as exc:  # one bad request never takes the host down
                self._log.exception(
                    "message_handling_failed", kind=type(envelope.header).__name__, reason=repr(exc)
                )

    def _reject(self, header: object, reason: str) -> None:
        """Log a request this agent cannot act on; tell its sender where it can be told."""
        self._log.warning("message_rejected", kind=type(header).__name__, reason=reason)
        refused = refusable_spawn(header)
        if refused is not None:  # its owner waits for these procs: each call must end
            owner, proc_ids = refused
            why = f"the host agent refused the request: {reason}"
            for proc_id in proc_ids:
                self._send(owner, SpawnFailed(proc_id, self._hostname, why))

    def _handle(self, envelope: Envelope) -> None:
        header = envelope.header
        if type(header) is SpawnProcs:
            self._spawn(header)
        elif type(header) is StopProcs:
            self._stop(header.proc_ids, header.grace_s, header.reply_to)
        elif type(header) is Heartbeat:
            self._on_heartbeat(header.proc_id)
        elif type(header) is OwnerAlive:
            self._on_owner_alive(header.owner)
        elif type(header) is ProcReady:
            self._on_proc_ready(header)
        elif type(header) is WatchProcs:
            self._watch(header)
        elif type(header) is ShutdownAgent:
            self._shutdown(header.grace_s)
        elif type(header) is SpawnFailed:
            self._on_start_failed(header)
        elif type(header) is SetFaultRules:
            apply_fault_rules(envelope)
        else:
            self._log.warning("message_ignored", kind=type(header).__name__)

    def _spawn(self, request: SpawnProcs) -> None:
        for spec in request.procs:
            if self._shutting_down:
                self._send(
                    request.owner,
                    SpawnFailed(spec.proc_id, self._hostname, "the host agent is shutting down"),
                )
                continue
            if spec.proc_id in self._procs:
                self._send(
                    request.owner,
                    SpawnFailed(spec.proc_id, self._hostname, "a proc with this id runs already"),
                )
                continue
            address = self._proc_address(spec.proc_id)
            too_long = _socket_path_too_long(address)
            if too_long is not None:
                self._send(request.owner, SpawnFailed(spec.proc_id, self._hostname, too_long))
                continue
            proc = _Proc(
                spec,
                request.owner,
                address,
                request.heartbeat_timeout_s,
                request.busy_timeout_s,
            )
            proc.watchers = self._exited_watchers.pop(spec.replaces, set())
            proc.silent_since = time.monotonic() + _STARTUP_GRACE_S
            proc.heartbeat_due = proc.silent_since + request.heartbeat_timeout_s
            self._procs[spec.proc_id] = proc
            for other in self._procs.values():
                if other.address == request.owner:
                    other.owned_by_proc.add(spec.proc_id)
            config = {
                "proc_id": spec.proc_id,
                "mesh_name": spec.mesh_name,
                "labels": spec.labels,
                "sizes": spec.sizes,
                "rank": spec.rank,
                "address": address,
                "owner": request.owner,
                "agent": self._inbox.address,
                "rundir": self._rundir,
                "env": dict(request.env),
                "sys_path": request.sys_path,
                "cwd": request.cwd,
                "heartbeat_interval_s": request.heartbeat_interval_s,
            }
            point = dict(zip(spec.labels, _coords(spec.sizes, spec.rank)))
            self._forkserver.spawn(spec.proc_id, f"{spec.mesh_name} {point}", config)

    def _stop(self, proc_ids: tuple[str, ...], grace_s: float, reply_to: str | None = None) -> None:
        now = time.monotonic()
        for proc_id in proc_ids:
            proc = self._procs.get(proc_id)
            if proc is None and reply_to is not None:
                self._send(reply_to, self._exited.get(proc_id) or self._unknown(proc_id))
            if proc is None or proc.stop_requested:
                continue
            proc.stop_requested = True
            proc.kill_at = now + grace_s
            if grace_s > 0:
                self._send(proc.address, StopProc())
            else:
                self._kill(proc)

    def _proc_address(self, proc_id: str) -> str:
        """Where a new proc listens: next to this agent (ipc), or on its interface (tcp)."""
        mine = self._inbox.address
        if mine.startswith("tcp://"):
            return f"tcp://{mine[len('tcp://') :].rsplit(':', 1)[0]}:*"
        return f"ipc://{self._rundir}/{proc_id}"

    def _on_proc_ready(self, ready: ProcReady) -> None:
        proc = self._procs.get(ready.proc_id)
        if proc is None:
            return
        proc.address = ready.address  # a tcp proc picked its port itself
        if proc.spec.replaces:  # holders of handles to the old proc learn where it went
            moved = ProcReplaced(
                proc.spec.replaces, ready.proc_id, ready.address, ready.pid, ready.host
            )
            for watcher in proc.watchers:
                self._send(watcher, moved)

    def _on_start_failed(self, failed: SpawnFailed) -> None:
        """A proc says why it cannot start (it exits next): its exit report will say so."""
        proc = self._procs.get(failed.proc_id)
        if proc is not None:
            proc.failure = failed.reason[:2000]

    def _on_owner_alive(self, owner: str) -> None:
        self._owners_seen[owner] = time.monotonic()
        self._send(owner, AgentAlive(self.address, self._incarnation))

    def _reap_orphans(self, now: float) -> None:
        """Stop the procs of network owners that stopped sending OwnerAlive."""
        for owner, seen in list(self._owners_seen.items()):
            if now - seen > self._owner_timeout_s:
                del self._owners_seen[owner]
                orphans = tuple(p.spec.proc_id for p in self._procs.values() if p.owner == owner)
                self._log.warning(
                    "owner_gone",
                    owner=owner,
                    procs=len(orphans),
                    reason=f"no sign of life for {self._owner_timeout_s} s",
                )
                self._stop(orphans, self._orphan_timeout_s)

    def _on_heartbeat(self, proc_id: str) -> None:
        proc = self._procs.get(proc_id)
        if proc is not None:
            proc.silent_since = now = time.monotonic()
            proc.heartbeat_due = now + proc.heartbeat_timeout_s
            if proc.pid is not None:  # the baseline for judging a later silence
                proc.cpu, proc.cpu_at = sample_cpu(proc.pid), now

    def _watch(self, request: WatchProcs) -> None:
        for proc_id in request.proc_ids:
            proc = self._procs.get(proc_id)
            if proc is not None:
                proc.watchers.add(request.watcher)
            elif proc_id in self._exited:
                self._send(request.watcher, self._exited[proc_id])

    def request_shutdown(self) -> None:
        """From a signal handler: stop all procs gracefully and exit once they are gone."""
        self._shutdown_requested = True

    def _shutdown(self, grace_s: float) -> None:
        self._shutting_down = True
        self._stop(tuple(self._procs), grace_s)

    # -- fork server reports -------------------------------------------------------------------

    def _drain_forkserver(self) -> None:
        while True:
            report = self._forkserver.receive()
            if report is None:
                self._log.error("forkserver_gone")
                raise SystemExit(1)
            if not report:
                return
            if report[0] == "spawned":
                self._on_spawned(report[1], report[2])
            elif report[0] == "exited":
                self._drain_inbox()  # what the proc said before it exited comes first
                self._on_exited(report[1], report[2])
            elif report[0] == "spawn_failed":
                proc = self._procs.pop(report[1], None)
                if proc is not None:
                    self._send(proc.owner, SpawnFailed(report[1], self._hostname, report[2]))

    def _on_spawned(self, proc_id: str, pid: int) -> None:
        proc = self._procs.get(proc_id)
        if proc is None:  # not ours (any more): nobody would ever stop it
            self._forkserver.signal(pid, signal.SIGKILL)
            return
        proc.pid = pid
        proc.cpu, proc.cpu_at = sample_cpu(pid), time.monotonic()
        self._by_pid[pid] = proc_id
        self._log.info("proc_spawned", proc=proc_id, pid=pid)
        if proc.stop_requested and proc.kill_at is not None and proc.kill_at <= time.monotonic():
            self._kill(proc)

    def _on_exited(self, pid: int, status: int) -> None:
        proc_id = self._by_pid.pop(pid, None)
        proc = self._procs.pop(proc_id, None) if proc_id else None
        if proc is None:
            return
        code = os.waitstatus_to_exitcode(status)
        signame = signal.Signals(-code).name if code < 0 else None
        self._log.info(
            "proc_exited",
            proc=proc_id,
            pid=pid,
            exit_code=code,
            signal=signame,
            requested=proc.stop_requested,
        )
        self._outbox.forget(proc.address)
        self._remove_sockets_of(proc.spec.proc_id)
        report = ProcExited(
            proc.spec.proc_id,
            pid,
            self._hostname,
            None if code < 0 else code,
            signame,
            proc.stop_requested and not proc.hung,
            proc.hung,
            proc.why_hung,
        )
        for address in {proc.owner, *proc.watchers}:
            if proc.failure is not None:
                self._send(address, SpawnFailed(proc.spec.proc_id, self._hostname, proc.failure))
            self._send(address, report)
        self._remember(report, proc.watchers)
        self._stop(tuple(proc.owned_by_proc), 0.0)  # a mesh never outlives its owner

    def _remove_sockets_of(self, proc_id: str) -> None:
        """Remove the socket files of a proc that exited: a killed one could not."""
        for path in (
            os.path.join(self._rundir, proc_id),
            *glob.glob(os.path.join(glob.escape(self._rundir), f"{glob.escape(proc_id)}-r*")),
        ):
            with contextlib.suppress(OSError):
                os.unlink(path)

    def _unknown(self, proc_id: str) -> ProcExited:
        """The report for a proc this agent never ran (it ran under a previous agent)."""
        return ProcExited(proc_id, 0, self._hostname, None, None, requested=True)

    def _remember(self, report: ProcExited, watchers: set[str]) -> None:
        self._exited[report.proc_id] = report
        if watchers:
            self._exited_watchers[report.proc_id] = watchers
        if len(self._exited) > _EXITED_MEMORY:
            oldest = next(iter(self._exited))
            del self._exited[oldest]
            self._exited_watchers.pop(oldest, None)

    # -- helpers -------------------------------------------------------------------------------

    def _kill(self, proc: _Proc) -> None:
        if proc.pid is not None:
            self._forkserver.signal(proc.pid, signal.SIGKILL)
            proc.kill_at = None

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        self._reap_orphans(now)
        for proc in list(self._procs.values()):
            if proc.kill_at is not None and proc.kill_at <= now:
                self._kill(proc)
            elif proc.pid is not None and not proc.stop_requested and proc.heartbeat_due <= now:
                self._judge_silence(proc, proc.pid, now)

    def _judge_silence(self, proc: _Proc, pid: int, now: float) -> None:
        """`proc` missed its heartbeats: kill it as hung, unless it is busy (not stopped, and
        it used CPU time since the last sample or waits for a core): that buys it time, up to
        its busy limit."""
        sample = sample_cpu(pid, threads=True)
        if sample is not None and sample.exited:  # its exit report is on the way: not hung
            proc.heartbeat_due = now + proc.heartbeat_timeout_s
            return
        why = _why_hung(proc, sample, now)
        if why is None:
            self._log.info("proc_busy", proc=proc.spec.proc_id, pid=pid)
            proc.cpu, proc.cpu_at = sample, now
            busy_until = proc.silent_since + proc.busy_timeout_s
            proc.heartbeat_due = min(now + proc.heartbeat_timeout_s, busy_until)
            return
        self._log.warning("proc_hung", proc=proc.spec.proc_id, pid=pid, reason=why)
        proc.hung = proc.stop_requested = True
        proc.why_hung = why
        self._kill(proc)

    def _forgive_absence(self, wait_s: float) -> None:
        """The agent's own absence (paused, starved of CPU) is not its procs' silence: their
        deadlines move by as long as the loop overslept; after a real pause, when messages
        sent meanwhile may still be on their way in, each restarts from now."""
        now = time.monotonic()
        late_s = max(0.0, now - self._last_check - wait_s)
        self._last_check = now
        paused = late_s > _PAUSE_S
        if paused:
            self._log.info("agent_was_paused", seconds=round(late_s, 3))
        for proc in self._procs.values():
            proc.heartbeat_due += late_s
            proc.silent_since += late_s
            if paused:
                proc.silent_since = max(proc.silent_since, now)
                proc.heartbeat_due = max(proc.heartbeat_due, now + proc.heartbeat_timeout_s)
        for owner, seen in self._owners_seen.items():
            self._owners_seen[owner] = max(seen + late_s, now) if paused else seen + late_s

    def _next_timeout(self) -> float:
        deadlines = [
            p.kill_at if p.kill_at is not None else p.heartbeat_due
            for p in self._procs.values()
            if p.pid is not None or p.kill_at is not None
        ]
        if self._owners_seen:
            deadlines.append(min(self._owners_seen.values()) + self._owner_timeout_s)
        return max(0.0, min(deadlines, default=time.monotonic() + 1.0) - time.monotonic())

    def _send(self, address: str, header: object) -> None:
        from transport import TransportError, encode

        try:
            self._outbox.send(address, encode(header))
        except TransportError as exc:
            self._log.warning("send_failed", to=address, reason=str(exc))

    def _close(self) -> None:
        self._log.info("agent_stopped")
        self._outbox.close(linger_ms=1000)
        self._inbox.close()
        close_context(self._zmq)


def _why_hung(proc: _Proc, sample: CpuSample | None, now: float) -> str | None:
    """Why `proc`, silent since `proc.silent_since` and sampled `sample` now, is hung; None
    while it is busy (it progresses, and its busy limit is not reached)."""
    silent_s = now - proc.silent_since
    if sample is not None and sample.stopped:
        return f"no heartbeat for {silent_s:.1f} s, and it is stopped (SIGSTOP or a debugger)"
    if not progressed(proc.cpu, sample, now - proc.cpu_at):
        return (
            f"no heartbeat for {silent_s:.1f} s, and it used no CPU time meanwhile "
            "(blocked or deadlocked)"
        )
    if silent_s >= proc.busy_timeout_s:
        return (
            f"no heartbeat for {silent_s:.1f} s while it kept using CPU time: busy but "
            f"unresponsive for longer than busy_timeout_s ({proc.busy_timeout_s:g} s)"
        )
    return None


#: The longest unix socket path (sun_path holds 108 bytes with the NUL), less the room a
#: proc's reply inboxes add to its own ("-r" and a number).
_MAX_SOCKET_PATH = 107 - 6


def _socket_path_too_long(address: str) -> str | None:
    """Why a proc cannot listen at ipc `address` (a path too long for a unix socket), or None."""
    if not address.startswith("ipc://"):
        return None
    length = len(os.fsencode(address[len("ipc://") :]))
    if length <= _MAX_SOCKET_PATH:
        return None
    return (
        f"its socket path {address[len('ipc://') :]!r} is {length} bytes long, over the "
        f"{_MAX_SOCKET_PATH}-byte limit of unix socket paths; give the host agent a shorter "
        "run directory (--rundir, or a shorter XDG_RUNTIME_DIR or TMPDIR)"
    )


def _coords(sizes: tuple[int, ...], rank: int) -> list[int]:
    coords = []
    for size in reversed(sizes):
        rank, index = divmod(rank, size)
        coords.append(index)
    return list(reversed(coords))


def _remove_stale_sockets(rundir: str, keep: str) -> None:
    """Remove the sockets that procs of a previous agent left in `rundir` (a restarted agent
    reuses its directory; its old procs were killed with the old agent)."""
    try:
        entries = list(os.scandir(rundir))
    except OSError:
        return
    for entry in entries:
        path = entry.path
        if f"ipc://{path}" != keep and stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
            with contextlib.suppress(OSError):
                os.unlink(path)


def main(argv: list[str] | None = None, prog: str = "python -m mesh._agent") -> None:
    parser = argparse.ArgumentParser(prog=prog, description="Run a meshvisor host agent.")
    parser.add_argument(
        "--listen",
        "--address",
        dest="address",
        default="tcp://127.0.0.1:0",
        help="where to listen: tcp://HOST:PORT (port 0 picks one) or ipc://PATH;"
        " default tcp://127.0.0.1:0 (loopback only)",
    )
    parser.add_argument(
        "--rundir", default=None, help="private directory for ipc sockets (default: a new one)"
    )
    parser.add_argument(
        "--address-file", default=None, help="write the address actually listened on to this file"
    )
    parser.add_argument(
        "--owner-pid",
        type=int,
        default=None,
        help="local owner process: when it exits, stop everything and exit",
    )
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="a daemon that must not outlive this process (e.g. a test harness); its owners "
        "are still the clients that spawn procs on it",
    )
    parser.add_argument(
        "--orphan-timeout",
        type=float,
        default=0.0,
        help="seconds procs get to stop gracefully once the owner is gone, then SIGKILL",
    )
    parser.add_argument(
        "--owner-timeout",
        type=float,
        default=3.0,
        help="a network owner silent this long is considered gone",
    )
    parser.add_argument(
        "--keys",
        default=None,
        help="directory of the allocation's CURVE keys (meshvisor keys DIR): authenticate and "
        "encrypt every tcp connection, refusing peers without them. Default on tcp: "
        "$MESHVISOR_CURVE_KEYS, else keys made for the allocation (or address file) F in F.keys",
    )
    parser.add_argument(
        "--allocation",
        default=None,
        help="add this agent's address to the named allocation (or file)",
    )
    parser.add_argument(
        "--preload",
        default=None,
        help="modules (comma-separated) for the fork server to import before it forks procs, "
        "so that they start with them loaded (e.g. torch)",
    )
    parser.add_argument(
        "--remove-rundir",
        action="store_true",
        help="remove the run directory if the owner dies without cleaning up",
    )
    args = parser.parse_args(argv)
    raise_open_file_limit()  # each proc costs the agent descriptors; procs inherit it
    if args.keys:
        use_curve_keys(os.path.abspath(args.keys))  # procs inherit it
    address = (
        args.address.replace(":0", ":*") if args.address.startswith("tcp://") else args.address
    )
    if address.startswith("tcp://"):
        try:
            _use_keys(args)
            check_exposure(address[len("tcp://") :].rsplit(":", 1)[0])
        except TransportError as error:
            parser.error(str(error))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rundir = args.rundir or _own_run_dir()
    if args.preload:
        os.environ[PRELOAD_ENV] = args.preload
        reload_settings()  # the fork server preloads what its settings name
    forkserver = start_forkserver()
    agent = HostAgent(
        forkserver,
        address,
        rundir,
        args.owner_pid,
        args.orphan_timeout,
        args.owner_timeout,
        args.parent_pid,
    )
    signal.signal(signal.SIGTERM, lambda *_: agent.request_shutdown())
    if args.address_file:
        _write_atomically(args.address_file, agent.address + "\n")
    if args.allocation:
        from mesh._api.attach import add_to_allocation

        add_to_allocation(args.allocation, agent.address)
    try:
        agent.serve()
    finally:
        if args.allocation:
            from mesh._api.attach import remove_from_allocation

            with contextlib.suppress(OSError):
                remove_from_allocation(args.allocation, agent.address)
        with contextlib.suppress(OSError):
            forkserver.socket.close()
        with contextlib.suppress(ChildProcessError):
            os.waitpid(forkserver.pid, 0)
        if (args.remove_rundir and agent.owner_died) or args.rundir is None:
            shutil.rmtree(rundir, ignore_errors=True)
    sys.exit(0)


def _own_run_dir() -> str:
    """A new private run directory for a daemon, marked as this process's so that the next
    meshvisor process sweeps it if this one is killed; stale ones are swept now."""
    from mesh._engine.session import sweep_stale_run_dirs, write_owner_file

    rundir = private_runtime_dir("meshvisor-agent-")
    write_owner_file(rundir)
    sweep_stale_run_dirs(os.path.dirname(rundir))
    return rundir


def _use_keys(args: argparse.Namespace) -> None:
    """Set the CURVE keys this tcp agent and its procs use: --keys, else MESHVISOR_CURVE_KEYS,
    else a key pair made for its allocation (or address file) F, in the private F.keys."""
    if args.keys:
        use_curve_keys(os.path.abspath(args.keys))  # procs inherit it
        return
    if transport_settings().curve_keys:
        return
    if args.allocation:
        from mesh._api.attach import allocation_keys_dir

        directory = allocation_keys_dir(args.allocation).absolute()
    elif args.address_file:
        directory = Path(os.path.abspath(args.address_file) + ".keys")
    else:
        return  # check_exposure explains what to pass
    CurveKeys.create_or_load(directory)
    use_curve_keys(str(directory))
    print(
        f"meshvisor agent: no --keys given: every tcp connection is authenticated with the "
        f"CURVE keys in {directory} (attach() by allocation finds them; elsewhere set "
        f"{KEYS_ENV}={directory})",
        file=sys.stderr,
        flush=True,
    )


def _write_atomically(path: str, text: str) -> None:
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as handle:
        handle.write(text)
    os.replace(temporary, path)
