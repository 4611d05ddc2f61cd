"""`HostAgent`: serves one host: spawns procs, watches them (a `ProcTable`, a `Watchdog`), stops
them, reports to owners. One loop waits on its inbox, its fork server (procs forked, exited: known
as it reaps them), its local owner's pidfd, notices and SIGTERM; without an owner, procs stop."""

from __future__ import annotations

import os
import selectors
import signal
import time

from mesh._agent.detached import DetachedMeshes
from mesh._agent.evidence import declare_hung, exit_report_with_evidence, note_ready
from mesh._agent.forkserver import ForkRequest, ForkServerClient
from mesh._agent.notices import NoticeWatch
from mesh._agent.output_relay import forwarded_report
from mesh._agent.procs import ProcRecord, ProcTable, exit_code_and_signal, unknown_proc_report
from mesh._agent.relay import FanOutRelay
from mesh._agent.rundir import remove_proc_sockets, remove_stale_sockets
from mesh._agent.shutdown_request import ShutdownRequest
from mesh._agent.snapshots import AgentView
from mesh._agent.spawning import output_prefix, proc_address, proc_config, socket_path_too_long
from mesh._agent.watchdog import Watchdog
from mesh._agent.workspace import Workspaces
from mesh._engine.fault_rules import apply_fault_rules
from mesh._engine.log_messages import SyncOutput
from mesh._engine.messages import (
    AgentAlive,
    Heartbeat,
    OwnerAlive,
    PreemptionNotice,
    ProcReady,
    ProcReplaced,
    ProcSpec,
    Reply,
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
from mesh._settings import current_settings
from transport import (
    Envelope,
    LoneInbox,
    Outbox,
    TransportError,
    close_context,
    configured_keys,
    encode,
    get_logger,
    lone_shape,
    new_context,
)

#: Seconds procs get to stop when the agent is asked to shut down (SIGTERM), then SIGKILL.
DEFAULT_GRACE_S = 5.0


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
        notices: NoticeWatch | None = None,
    ) -> None:
        self._forkserver = forkserver
        self._notices = notices
        self._rundir = rundir
        self._zmq = new_context()
        self._inbox = LoneInbox(self._zmq, address, lone_shape(Reply))  # procs' answers
        self._outbox = Outbox(self._zmq)
        self._hostname = current_settings().host_name  # a SLURM node's name, on SLURM
        self._log = get_logger("mesh.agent", address=self._inbox.address)  # as bound
        self._procs = ProcTable()
        self._watchdog = Watchdog(self._procs, owner_timeout_s, self._log)
        watched = owner_pid or parent_pid  # when it exits, everything stops
        self._owner_fd = os.pidfd_open(watched) if watched else None
        self._shutting_down = False
        self._orphan_timeout_s = orphan_timeout_s
        self._asked_to_stop = ShutdownRequest()
        self.address, self.owner_died = self._inbox.address, False
        self._incarnation = f"{os.getpid()}-{time.time_ns()}"
        self._view = AgentView(self._procs, self._outbox, self._hostname, self.address, self._log)
        parts = (self._procs, self._watchdog, self._outbox, self._stop, self._log)
        self._detached = DetachedMeshes(*parts, (self.address, self._hostname), not owner_pid)
        self._ws = Workspaces(rundir, self._outbox, self.address, self._log).handle
        self._relay = FanOutRelay(self._procs, self._outbox, self.address, self._log)
        if owner_pid is None:  # a daemon: the run directory is its own
            remove_stale_sockets(rundir, keep=self.address)

    def serve(self) -> None:
        """Serve until shut down (asked to, or the owner died) and every proc is gone."""
        selector = selectors.DefaultSelector()
        selector.register(self._inbox.fileno(), selectors.EVENT_READ, "inbox")
        selector.register(self._forkserver.socket, selectors.EVENT_READ, "forkserver")
        if self._owner_fd is not None:
            selector.register(self._owner_fd, selectors.EVENT_READ, "owner")
        refusals = self._inbox.watch_refusals() if configured_keys() is not None else None
        if refusals is not None:
            selector.register(refusals.fileno(), selectors.EVENT_READ, "refusals")
        if self._notices is not None:
            selector.register(self._notices.fileno(), selectors.EVENT_READ, "notices")
        selector.register(self._asked_to_stop.fileno(), selectors.EVENT_READ, "shutdown")
        self._log.info("agent_started", pid=os.getpid())
        self._watchdog.start()
        while True:
            self._relay.drain(self._inbox, self._take)  # and the answers that came together leave
            if refusals is not None:  # edge-triggered like the inbox: drain every time
                refusals.drain()
            if self._asked_to_stop.asked and not self._shutting_down:
                self._shutdown(DEFAULT_GRACE_S)
            if self._shutting_down and not self._procs:
                break
            self._watch_forkserver(selector)
            wait_s = self._relay.due_in(self._watchdog.next_timeout())  # held answers first
            for key, mask in selector.select(self._watchdog.waiting(wait_s)):
                if key.data == "forkserver":
                    if mask & selectors.EVENT_WRITE:
                        self._forkserver.flush()
                    if mask & selectors.EVENT_READ:
                        self._drain_forkserver()
                elif key.data == "refusals" and refusals is not None:
                    refusals.drain()
                elif key.data == "owner":
                    selector.unregister(key.fd)
                    self._on_owner_exited()
                elif key.data == "notices" and self._notices is not None:
                    for name, left in self._notices.take():
                        self._on_notice(name, left)
                elif key.data == "shutdown":
                    self._asked_to_stop.drain()
            self._watchdog.woke()
            self._relay.drain(self._inbox, self._take)  # heartbeats queued meanwhile count first
            self._enforce_deadlines()
            if self._shutting_down and not self._procs:
                break
        if refusals is not None:
            refusals.close()
        self._close()

    def request_shutdown(self) -> None:
        """From a signal handler: stop all procs gracefully and exit once they are gone."""
        self._asked_to_stop.ask()

    def _watch_forkserver(self, selector: selectors.BaseSelector) -> None:
        """Read the fork server's reports; also wait for room to send while requests queue."""
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self._forkserver.pending else 0)
        selector.modify(self._forkserver.socket, events, "forkserver")

    # -- requests ------------------------------------------------------------------------------

    def _take(self, envelope: Envelope) -> None:
        reason = invalid_request(envelope.header)
        if reason is not None:
            self._reject(envelope.header, reason)
            return
        try:
            if not self._relay.handle(envelope):  # fanned-out calls first: the hot path
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
            self._procs.note_stop_why(header.proc_ids, header.why)  # its watchers hear it
            self._stop(header.proc_ids, header.grace_s, header.reply_to)
        elif type(header) is Heartbeat:
            if (proc := self._procs.get(header.proc_id)) is not None:
                self._watchdog.heartbeat(proc)
        elif type(header) is OwnerAlive:
            self._watchdog.owner_alive(header.owner)
            self._send(header.owner, AgentAlive(self.address, self._incarnation))
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
        elif type(header) is SyncOutput:
            self._forkserver.sync_output(header)
        elif not (self._view.handle(header) or self._detached.handle(envelope) or self._ws(header)):
            self._log.warning("message_ignored", kind=type(header).__name__)

    def _spawn(self, request: SpawnProcs) -> None:
        """Start the procs of `request` in one batch of the fork server (refusing some)."""
        batch: list[ForkRequest] = []
        for spec in request.procs:
            address = proc_address(self._inbox.address, self._rundir, spec.proc_id)
            refusal = self._spawn_refusal(spec, address)
            if refusal is not None:
                self._send(request.owner, SpawnFailed(spec.proc_id, self._hostname, refusal))
                continue
            self._procs.add(ProcRecord.requested(request, spec, address))
            config = proc_config(request, spec, address, self._inbox.address, self._rundir)
            batch.append((spec.proc_id, output_prefix(spec), config))
        if batch:
            self._forkserver.spawn(batch)

    def _spawn_refusal(self, spec: ProcSpec, address: str) -> str | None:
        """Why this agent cannot start `spec` at `address` now, or None."""
        if self._shutting_down:
            return "the host agent is shutting down"
        if spec.proc_id in self._procs:
            return "a proc with this id runs already"
        return socket_path_too_long(address)

    def _stop(self, proc_ids: tuple[str, ...], grace_s: float, reply_to: str | None = None) -> None:
        """Ask procs to stop, SIGKILLed after `grace_s`; tell `reply_to` about those gone."""
        now = time.monotonic()
        for proc_id in proc_ids:
            proc = self._procs.get(proc_id)
            if proc is None and reply_to is not None:
                gone = self._procs.exit_report(proc_id)
                self._send(reply_to, gone or unknown_proc_report(proc_id, self._hostname))
            if proc is None or proc.stop_requested:
                continue
            proc.stop_requested, proc.kill_at = True, now + grace_s
            if grace_s <= 0:
                self._kill(proc)
            elif proc.connected or "*" not in proc.address:  # a tcp proc's port comes with
                self._send(proc.address, StopProc())  # its ProcReady: asked to stop then

    def _on_proc_ready(self, ready: ProcReady) -> None:
        if (proc := self._procs.get(ready.proc_id)) is None:
            return
        told, proc.address = "*" not in proc.address, ready.address  # tcp: it picked its port
        proc.connected = True
        note_ready(proc)
        if proc.stop_requested and not told:  # asked to stop when it could not be told
            self._send(proc.address, StopProc())
        if proc.spec.replaces:  # holders of handles to the old proc learn where it went
            moved = ProcReplaced(
                proc.spec.replaces, ready.proc_id, ready.address, ready.pid, ready.host
            )
            for watcher in proc.watchers:
                self._send(watcher, moved)

    def _on_start_failed(self, failed: SpawnFailed) -> None:
        """A proc says why it cannot start (it exits next): its exit report will say so."""
        if (proc := self._procs.get(failed.proc_id)) is not None:
            proc.failure = failed.reason[:2000]

    def _watch(self, request: WatchProcs) -> None:
        for proc_id in request.proc_ids:
            proc = self._procs.get(proc_id)
            if proc is not None:
                proc.watchers.add(request.watcher)
            elif (gone := self._procs.exit_report(proc_id)) is not None:
                self._send(request.watcher, gone)

    def _shutdown(self, grace_s: float) -> None:
        self._shutting_down = True
        self._stop(self._procs.ids(), grace_s)

    def _on_owner_exited(self) -> None:
        """The local owner process exited: stop everything, giving procs the orphan timeout."""
        self._log.warning("owner_gone", reason="the client process exited")
        self.owner_died = True
        self._shutdown(grace_s=self._orphan_timeout_s)

    def _on_notice(self, signame: str, time_left_s: float | None) -> None:
        """The notice signal came (the host goes away soon): tell the owner of every proc."""
        self._log.warning("notice_received", signal=signame, time_left_s=time_left_s)
        for owner, ids in self._procs.ids_by_owner().items():
            self._send(owner, PreemptionNotice(ids, self._hostname, signame, time_left_s))

    # -- fork server reports -------------------------------------------------------------------

    def _drain_forkserver(self) -> None:
        while True:
            report = self._forkserver.receive()
            if report is None:  # with a SIGTERM to all of a job step (scancel): a clean stop
                self._log.error("forkserver_gone")
                raise SystemExit(0 if self._asked_to_stop.asked else 1)
            if not report:
                return
            if report[0] == "spawned":
                self._on_spawned(report[1], report[2])
            elif report[0] == "exited":
                self._relay.drain(self._inbox, self._take)  # what it said before it exited first
                self._on_exited(report[1], report[2])
            elif report[0] in ("output", "synced"):
                self._send(*forwarded_report(report))
            elif report[0] == "spawn_failed":
                proc = self._procs.discard(report[1])
                if proc is not None:
                    self._send(proc.owner, SpawnFailed(report[1], self._hostname, report[2]))

    def _on_spawned(self, proc_id: str, pid: int) -> None:
        if (proc := self._procs.get(proc_id)) is None:  # not ours (any more): nobody would stop it
            self._forkserver.signal(pid, signal.SIGKILL)
            return
        self._procs.bind_pid(proc, pid)
        self._watchdog.forked(proc)
        self._log.info("proc_spawned", proc=proc_id, pid=pid)
        if proc.stop_requested and proc.kill_at is not None and proc.kill_at <= time.monotonic():
            self._kill(proc)

    def _on_exited(self, pid: int, status: int) -> None:
        proc = self._procs.pop_exited(pid)
        if proc is None:
            return
        code, signame = exit_code_and_signal(status)
        proc.note_exit_before_connecting(code, signame)
        self._log.info(
            "proc_exited",
            proc=proc.proc_id,
            pid=pid,
            exit_code=code,
            signal=signame,
            requested=proc.stop_requested,
        )
        self._outbox.forget(proc.address)
        remove_proc_sockets(self._rundir, proc.proc_id)
        self._relay.proc_exited(proc.proc_id)
        report = exit_report_with_evidence(proc, pid, code, signame, self._hostname, self._rundir)
        for address in self._detached.recipients(proc, report):
            if proc.failure is not None:
                self._send(address, SpawnFailed(proc.proc_id, self._hostname, proc.failure))
            self._send(address, report)
        self._procs.remember(report, proc.watchers)
        self._stop(tuple(proc.owned_by_proc), 0.0)  # a mesh never outlives its owner

    # -- deadlines -----------------------------------------------------------------------------

    def _enforce_deadlines(self) -> None:
        """Stop the procs of owners gone silent, kill those past their grace, and the hung."""
        now = time.monotonic()
        self._detached.tick(now)
        for owner in self._watchdog.gone_owners(now):
            self._stop_orphans_of(owner)
        for proc in self._procs:
            if proc.kill_at is not None and proc.kill_at <= now:
                self._kill(proc)
        if next(self._watchdog.overdue(now), None) is not None:
            self._drain_forkserver()  # exits reported meanwhile first: a dead proc is not hung
        for proc, pid, why in self._watchdog.hung(now):
            self._log.warning("proc_hung", proc=proc.proc_id, pid=pid, reason=why)
            declare_hung(self._forkserver, proc, why, now)

    def _stop_orphans_of(self, owner: str) -> None:
        """Stop the procs of a network owner gone silent (a warning only if it left some)."""
        orphans = self._procs.owned_by(owner)
        log = self._log.warning if orphans else self._log.info  # none: it ended cleanly
        log(
            "owner_gone",
            owner=owner,
            procs=len(orphans),
            reason=f"no sign of life for {self._watchdog.owner_timeout_s} s",
        )
        self._stop(orphans, self._orphan_timeout_s)

    def _kill(self, proc: ProcRecord) -> None:
        if proc.pid is not None:
            self._forkserver.signal(proc.pid, signal.SIGKILL)
            proc.kill_at = None

    def _send(self, address: str, header: object) -> None:
        try:
            self._outbox.send(address, encode(header))
        except TransportError as exc:
            self._log.warning("send_failed", to=address, reason=str(exc))

    def _close(self) -> None:
        self._log.info("agent_stopped")
        self._outbox.close(linger_ms=1000)
        self._inbox.close()
        self._asked_to_stop.close()
        close_context(self._zmq)
