"""The fork server: a single-threaded, pre-imported process that forks procs quickly.

The host agent forks it before creating any zmq context or thread, so each proc starts as a
copy of an interpreter that has already imported meshvisor (a few milliseconds instead of a
full interpreter start). The fork server is the procs' parent: it reaps them the moment they
exit and relays their stdout/stderr line by line (`output_relay`), never blocking on it.

Protocol over a SOCK_SEQPACKET pair, pickled tuples:
  agent → server  ("spawn", [(proc_id, prefix, config), ...]) | ("signal", pid, signum)
                  | ("sync", proc_ids, forward, reply_to, token, quiet)
                  (a config with a "bootstrap" command: the child executes it, see launching)
  server → agent  ("spawned", proc_id, pid) | ("spawn_failed", proc_id, reason)
                  | ("exited", pid, status) (reaped, or killed: `death_watch`)
                  | ("synced", reply_to, token)
                  | ("output", owner, proc_id, prefix, stream, lines)
Requests travel in packets of at most `_CHUNK` bytes, each starting with b"+" (more follow)
or b"." (the last), so that a request of any size fits; the agent queues them and sends as
the socket takes them, never blocking. Reports are small: one packet each.

A spawn request carries every proc of one request to the agent: the fork server preloads what
they need first, then forks them one after the other, reporting each pid at once, with no
round trip to the agent in between: a mesh's procs start together and initialize in parallel
(`warm_start` keeps each one cheap).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import selectors
import signal
import socket
import sys
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn

from mesh._agent.death_watch import DeathWatch
from mesh._agent.launching import exec_bootstrap, launch_refusal
from mesh._agent.log_files import LogFileConfig, RankLog
from mesh._agent.output_relay import Output, Relay, drain_relays, open_log_files
from mesh._agent.warm_start import WarmUp, freeze_inherited, warm_up_runtime
from mesh._engine.log_messages import SyncOutput
from mesh._settings import ENV_NAMES, current_settings

_PR_SET_PDEATHSIG = 1
_MAX_PACKET = 1 << 20
_CHUNK = 32 * 1024
_MORE, _LAST = b"+", b"."

#: One proc to fork: its id, the prefix of its output lines, its configuration (`proc_config`).
ForkRequest = tuple[str, str, dict[str, Any]]


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ForkServerClient:
    """The agent's end of the fork server."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.socket = sock
        self.pid = pid
        self._outgoing: deque[bytes] = deque()

    def spawn(self, batch: list[ForkRequest]) -> None:
        """Fork the procs of `batch` (proc id, output prefix, configuration) together."""
        self._send(("spawn", batch))

    def signal(self, pid: int, signum: int) -> None:
        self._send(("signal", pid, signum))

    def sync_output(self, request: SyncOutput) -> None:
        """Relay what the procs wrote so far; forward their lines to the agent from now on (or
        stop; or keep them in their log files only: quiet); then report ("synced", reply_to,
        token)."""
        sync = ("sync", request.proc_ids, request.forward, request.reply_to, request.token)
        self._send((*sync, request.quiet))

    def receive(self) -> tuple[Any, ...] | None:
        """One report, or None if the fork server is gone."""
        try:
            data = self.socket.recv(_MAX_PACKET)
        except BlockingIOError:
            return ()
        return pickle.loads(data) if data else None

    @property
    def pending(self) -> bool:
        """Whether requests wait for room in the socket (call `flush` once it is writable)."""
        return bool(self._outgoing)

    def flush(self) -> None:
        """Send queued packets until the socket is full (the fork server reads them)."""
        while self._outgoing:
            try:
                self.socket.send(self._outgoing[0])
            except BlockingIOError:
                return
            self._outgoing.popleft()

    def _send(self, request: tuple[Any, ...]) -> None:
        data = pickle.dumps(request)
        last = max(0, (len(data) - 1) // _CHUNK)
        for index in range(last + 1):
            flag = _LAST if index == last else _MORE
            self._outgoing.append(flag + data[index * _CHUNK : (index + 1) * _CHUNK])
        self.flush()


def start_forkserver(logs: LogFileConfig | None = None) -> ForkServerClient:
    """Fork the fork server from the current (single-threaded) process; it keeps its procs'
    lines in log files as `logs` says (none without).

    A proc forked by the fork server comes back out of this call (and only its own stack
    frames are left), runs, and leaves by ``SystemExit``: nothing around the call may catch
    that, so that a gracefully stopped proc shuts its interpreter down normally.
    """
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        ours.close()
        try:
            _serve(theirs, logs)
        except _ProcStart as start:
            config = start.config
        theirs.detach()  # its descriptor was closed by number in the proc; never close it again
        _run_proc(config)
    theirs.close()
    ours.setblocking(False)
    return ForkServerClient(ours, pid)


class _ProcStart(BaseException):
    """Raised in a proc just forked by the fork server, to leave the fork server's frames."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config["proc_id"])
        self.config = config


#: Modules the fork server imports before forking anything (comma-separated), so that procs
#: start with them loaded: e.g. ``torch``, which takes a second or two to import. In a proc's
#: `env` (``spawn_procs(env=...)``) it names modules to import before forking that proc: once,
#: so later procs of this fork server start with them loaded too.
PRELOAD_ENV = ENV_NAMES["preload"]
_preloaded: set[str] = set()  # modules tried already (imported, or failed and reported)


def _preload(names: tuple[str, ...] | list[str]) -> None:
    fresh = [name for name in names if name and name not in _preloaded]
    for name in fresh:
        _preloaded.add(name)
        try:
            importlib.import_module(name)
        except Exception as exc:
            print(f"meshvisor fork server: cannot preload {name!r}: {exc}", file=sys.stderr)
    if fresh:
        freeze_inherited()


def _serve(control: socket.socket, logs: LogFileConfig | None) -> NoReturn:
    die_with_parent()
    deaths = DeathWatch()  # sees a proc killed before its memory is freed; forks its waiter
    _preload(current_settings().preload)
    warm_up_runtime()
    warming = WarmUp()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    os.set_blocking(wake_read, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.set_wakeup_fd(wake_write)
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, "control")
    selector.register(wake_read, selectors.EVENT_READ, "wake")
    selector.register(deaths.fileno(), selectors.EVENT_READ, deaths)
    children: set[int] = set()
    outputs = (Output(1), Output(2))
    partial: list[bytes] = []  # the packets of a request still arriving
    try:
        while True:
            events = selector.select(None if warming.done else 0)
            if not events:
                warming.step()
            for key, _ in events:
                if key.data == "control":
                    request = _receive_request(control, partial)
                    if _is_spawn_of_many(request):
                        warming.finish()
                    if request is not None:
                        _handle_request(
                            request, control, selector, children, wake_read, (outputs, logs, deaths)
                        )
                elif key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_read, 4096)
                    _reap(control, children, deaths)
                elif key.data is deaths:
                    deaths.report(control, selector)
                elif selector.get_map().get(key.fd) is not key:  # drained to its end meanwhile
                    continue
                elif not key.data.pump():
                    selector.unregister(key.fd)
                    os.close(key.fd)
    except _ProcStart:  # in a new proc, not in the fork server: its siblings are not its own
        raise
    except BaseException:
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    os._exit(0)


def _is_spawn_of_many(request: Any) -> bool:
    return request is not None and request[0] == "spawn" and len(request[1]) > 1


def _receive_request(control: socket.socket, partial: list[bytes]) -> Any:
    """The request completed by the next packet, None while more packets are to come; exits
    when the agent is gone."""
    packet = control.recv(_MAX_PACKET)
    if not packet:
        raise SystemExit
    partial.append(packet[1:])
    if packet[:1] == _MORE:
        return None
    data = b"".join(partial)
    partial.clear()
    return pickle.loads(data)


def _handle_request(
    request: Any,
    control: socket.socket,
    selector: selectors.BaseSelector,
    children: set[int],
    wake_read: int,
    where: tuple[tuple[Output, Output], LogFileConfig | None, DeathWatch],
) -> None:
    if request[0] == "signal":
        with contextlib.suppress(ProcessLookupError):
            os.kill(request[1], request[2])
        return
    if request[0] == "sync":
        _sync_output(request, control, selector)
        return
    for proc_id, prefix, config in _startable(request[1], control):
        try:
            pid, relays = _fork_proc(config, prefix, control, selector, wake_read, where)
        except OSError as exc:
            control.send(pickle.dumps(("spawn_failed", proc_id, f"fork failed: {exc}")))
            continue
        children.add(pid)
        for relay in relays:
            selector.register(relay.fd, selectors.EVENT_READ, relay)
        control.send(pickle.dumps(("spawned", proc_id, pid)))
    where[2].commit()


def _startable(batch: list[ForkRequest], control: socket.socket) -> list[ForkRequest]:
    """The procs of `batch` that can be forked, their modules preloaded; the others are
    refused (reported on `control`)."""
    startable = []
    for proc_id, prefix, config in batch:
        refusal = launch_refusal(config) if config["bootstrap"] else None
        if refusal is not None:
            control.send(pickle.dumps(("spawn_failed", proc_id, refusal)))
            continue
        if not config["bootstrap"]:
            _preload([n.strip() for n in config["env"].get(PRELOAD_ENV, "").split(",")])
        startable.append((proc_id, prefix, config))
    return startable


def _sync_output(
    request: tuple[Any, ...], control: socket.socket, selector: selectors.BaseSelector
) -> None:
    """Relay what the procs of `request` wrote so far, switch them to forwarding their lines
    to the agent (or back), then say so: the agent tells the owner after those lines."""
    _, proc_ids, forward, reply_to, token, quiet = request
    wanted = set(proc_ids)
    for relay in drain_relays(selector, lambda relay: relay.proc_id in wanted):
        relay.forward_to = control if forward else None
        relay.owner = reply_to if forward else relay.owner  # an adopter asks for them
        relay.quiet = quiet
    control.send(pickle.dumps(("synced", reply_to, token)))


def _fork_proc(
    config: dict[str, Any],
    prefix: str,
    control: socket.socket,
    selector: selectors.BaseSelector,
    wake_read: int,
    where: tuple[tuple[Output, Output], LogFileConfig | None, DeathWatch],
) -> tuple[int, list[Relay]]:
    """Fork the proc of `config`, its output relayed to `where` (outputs, log files), its
    death watched by `where`'s `DeathWatch` (but for a launched proc: it executes a command)."""
    outputs, logs, deaths = where
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    slot = None if config["bootstrap"] else deaths.arm()
    try:
        pid = os.fork()
    except OSError:
        deaths.watch(slot, None)
        raise
    if pid == 0:
        inherited = [control.fileno(), wake_read, out_read, err_read, deaths.fileno()]
        inherited += [key.fd for key in selector.get_map().values()]
        inherited += [output.fd for output in outputs if output.fd > 2]
        inherited += open_log_files(selector)
        _become_proc(config, out_write, err_write, inherited, lambda: deaths.hold(slot))
    deaths.watch(slot, pid)
    os.close(out_write)
    os.close(err_write)
    relays = [Relay(out_read, outputs[0], 1, config, prefix, pid)]
    relays.append(Relay(err_read, outputs[1], 2, config, prefix, pid))
    rank_log = RankLog(logs, config, pid, current_settings().host_name) if logs else None
    for relay in relays:
        relay.forward_to = control if config["forward_output"] else None
        relay.quiet = config["quiet_output"]
        relay.log = rank_log
    return pid, relays


def _become_proc(
    config: dict[str, Any], out_fd: int, err_fd: int, inherited: list[int], hold: Callable[[], None]
) -> NoReturn:
    """In the forked child: hold its death watch's mutex, drop what belongs to the fork
    server, then leave its frames."""
    try:
        hold()
        die_with_parent()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in set(inherited):
            with contextlib.suppress(OSError):
                os.close(fd)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        if config["bootstrap"]:
            exec_bootstrap(config)
        freeze_inherited()  # also when forked before the fork server's own freeze (a lone proc)
    except BaseException:
        _exit_now(1, print_error=True)
    raise _ProcStart(config)


def _run_proc(config: dict[str, Any]) -> NoReturn:
    """Run the proc. After a graceful stop the interpreter exits normally (non-daemon threads
    joined, atexit handlers and ``__del__`` run); a proc that fails leaves at once."""
    try:
        from mesh._agent.proc_main import run_proc

        code = run_proc(config)
    except SystemExit as exc:
        _exit_now(exc.code if isinstance(exc.code, int) else 1)
    except BaseException:
        _exit_now(1, print_error=True)
    raise SystemExit(code)


def _exit_now(code: int, *, print_error: bool = False) -> NoReturn:
    if print_error:
        traceback.print_exc()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _reap(control: socket.socket, children: set[int], deaths: DeathWatch) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        if deaths.reaped(pid, status):  # not already told by `DeathWatch.report`
            control.send(pickle.dumps(("exited", pid, status)))
