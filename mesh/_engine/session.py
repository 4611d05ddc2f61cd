"""`Session`: this process's place in the tree: its runtime, its run directory and its agent.

The client gets a session on first use (``this_host()``, ``this_proc()``): a private run
directory, a runtime on a background thread and, on demand, a local host agent. A proc gets its
session from its agent's configuration.
"""

from __future__ import annotations

import atexit
import errno
import os
import secrets
import shutil
import subprocess
import sys
import threading
from typing import Any

from mesh._context import install_record_identity
from mesh._engine import notebook
from mesh._engine.failfast import FAIL_FAST
from mesh._engine.fork import check_not_forked, forked_from
from mesh._engine.messages import ShutdownAgent
from mesh._engine.run_dirs import sweep_stale_run_dirs, write_owner_file
from mesh._engine.runtime import Runtime
from mesh._settings import Settings
from transport import (
    TransportError,
    get_logger,
    private_runtime_dir,
    raise_open_file_limit,
    transport_settings,
    warm_logging,
)

_session: Session | None = None
_session_lock = threading.Lock()
AGENT_SHUTDOWN_GRACE_S = 5.0


class Session:
    """The runtime of this process plus what it needs to reach (or start) its host agent."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        rundir: str,
        agent: str | None = None,
        proc: tuple[str, tuple[str, ...], tuple[int, ...], int] | None = None,
    ) -> None:
        self.runtime = runtime
        self.rundir = rundir
        self.proc = proc
        self._agent = agent
        self._agent_process: subprocess.Popen[bytes] | None = None
        self._agent_watched = False  # its exit reported by the event loop (once that runs)
        self._lock = threading.Lock()
        self._log = get_logger("mesh.session")
        install_record_identity()  # logging records made in actors say which actor

    @property
    def local_agent(self) -> str | None:
        """The address of the agent this process started or was started by, if any."""
        return self._agent

    @property
    def is_client(self) -> bool:
        return self.proc is None

    def agent_address(self) -> str:
        """The local host agent's address, starting one first if this is the client."""
        with self._lock:
            if self._agent is None or (
                self._agent_process and self._agent_process.poll() is not None
            ):
                self._agent = self._launch_local_agent()
            if self._agent_process is not None and not self._agent_watched:
                self.runtime.agents.watch_agent_process(self._agent, self._agent_process.pid)
                self._agent_watched = True
            return self._agent

    def launch_local_agent(self) -> None:
        """Start the local agent now, before this client's event loop runs (`agent_address`
        watches it once the loop does): its start is most of a first spawn's wait, and the
        loop's own start then goes on beside it."""
        with self._lock:
            self._agent = self._launch_local_agent()

    def _launch_local_agent(self) -> str:
        address = f"ipc://{self.rundir}/agent-{secrets.token_hex(3)}"
        command = [
            sys.executable,
            "-m",
            "mesh._agent",
            "--address",
            address,
            "--rundir",
            self.rundir,
            "--owner-pid",
            str(os.getpid()),
            "--remove-rundir",
            "--orphan-timeout",
            str(self.runtime.settings.orphan_timeout_s),
        ]
        env = _agent_env(self.runtime.settings)
        self._agent_process = subprocess.Popen(command, start_new_session=True, env=env)
        self._agent_watched = False
        self._log.info("agent_launched", address=address, pid=self._agent_process.pid)
        return address

    def shutdown_local_agent(self, grace_s: float = AGENT_SHUTDOWN_GRACE_S) -> None:
        """Stop the local agent (and so every proc it runs); wait for it to exit."""
        with self._lock:
            process, address = self._agent_process, self._agent
            self._agent_process = None
            if process is not None:
                self._agent = None
        if process is None or address is None:
            return
        self.runtime.agents.agent_stopping(address)
        self.runtime.send_message(address, ShutdownAgent(grace_s))
        try:
            process.wait(grace_s + 2)
        except subprocess.TimeoutExpired:
            self._log.warning("agent_killed", pid=process.pid, reason="did not stop in time")
            process.kill()
            process.wait()

    def close(self) -> None:
        """Tear everything down: agent, event loop, sockets and, in the client, the run dir."""
        self.runtime.closing = True
        if self.is_client:
            self.runtime.procs.stop_all_owned(grace_s=1.0)  # on attached agents too
            self.shutdown_local_agent()
            self.runtime.stop_loop()
        self.runtime.close()
        if self.is_client:
            shutil.rmtree(self.rundir, ignore_errors=True)


def _agent_env(settings: Settings) -> dict[str, str]:
    """The environment of a local agent: this process's, with its current settings (so that the
    agent and its procs get what `mesh.configure` changed)."""
    env = {**os.environ, **settings.to_env(), **transport_settings().to_env()}
    paths = [p for p in sys.path if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONSAFEPATH"] = "1"  # import what the client imports, not whatever is in the cwd
    return env


def install_session(session: Session) -> None:
    global _session
    _session = session


def current_session(*, with_local_agent: bool = False) -> Session:
    """This process's session, created on first use in the client; `with_local_agent`: the
    caller needs the local agent, started first if the session is new (`launch_local_agent`)."""
    global _session
    if _session is not None:
        check_not_forked(_session.runtime.pid)
        return _session
    with _session_lock:
        if _session is None:
            raise_open_file_limit()  # each proc costs descriptors; its agent inherits this
            rundir, runtime = _start_client_runtime()
            session = Session(runtime, rundir=rundir)
            if with_local_agent:
                _launch_or_clean_up(session)
            runtime.start_in_thread()
            warm_logging()  # (off the path of the first failure)
            FAIL_FAST.install()
            notebook.install(FAIL_FAST)  # in a Jupyter kernel: never end the kernel
            _session = session
            atexit.register(_close_client_session)
    return _session


def _launch_or_clean_up(session: Session) -> None:
    """Launch `session`'s local agent; if that fails, leave no socket or run directory."""
    try:
        session.launch_local_agent()
    except BaseException:
        session.runtime.close()
        shutil.rmtree(session.rundir, ignore_errors=True)
        raise


def _start_client_runtime() -> tuple[str, Runtime]:
    """The client's run directory and runtime; a clear OSError, and nothing left behind, when
    they cannot be made (a full disk, a socket path too long)."""
    try:
        rundir = private_runtime_dir()
    except OSError as error:
        raise _session_error("cannot create its run directory", error) from error
    try:
        sweep_stale_run_dirs(os.path.dirname(rundir))
        write_owner_file(rundir)
        return rundir, Runtime(f"ipc://{rundir}/client", proc_id="client", is_root=True)
    except (OSError, TransportError) as error:
        shutil.rmtree(rundir, ignore_errors=True)
        raise _session_error(f"cannot set up its run directory {rundir}", error) from error


def _session_error(what: str, error: BaseException) -> OSError:
    code = getattr(error, "errno", None) or errno.EIO
    return OSError(
        code,
        f"cannot start a meshvisor session: it {what}: {error}; free some space, or point "
        "XDG_RUNTIME_DIR or TMPDIR at a writable directory with a short path",
    )


def current_runtime() -> Runtime:
    return current_session().runtime


def _close_client_session() -> None:
    global _session
    session, _session = _session, None
    if session is None or forked_from(session.runtime.pid):
        return  # a forked child must not stop its parent's procs and agent at its exit
    if session.is_client:
        session.close()


def shutdown_session() -> None:
    """Close the client session now (tests use this; atexit does it otherwise)."""
    _close_client_session()


def session_if_started() -> Any:
    return _session
