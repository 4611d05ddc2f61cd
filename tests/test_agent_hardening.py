"""Host agents under hostile or careless input: dead agents, undrained output, wrongly typed
messages, large requests, long names, full disks and stale bookkeeping.

Every test uses real agents, procs and sockets. Failures that reach the client are recorded by
the `root_events` fixture (so they never interrupt pytest) and looked at where they matter.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import actors
import pytest
from conftest import RUN_BASE, meshvisor_processes
from polling import wait_until
from test_fault_hooks import DaemonAgent, make_daemon  # noqa: F401 (a fixture)

import mesh._session
from mesh import attach, this_host
from supervision import SupervisionError

T = 30.0  # the bound on every wait (never reached when things work)


# -- 8: spawning on an agent that is gone ends ----------------------------------------------------


@pytest.mark.timeout(60)
def test_spawn_procs_on_a_killed_local_agent_fails(root_events: list[Any]) -> None:
    host = this_host()
    agent = mesh._session.current_session()._agent_process
    assert agent is not None
    agent.send_signal(signal.SIGKILL)
    agent.wait(T)
    procs = host.spawn_procs(per_host={"gpus": 2}, name="orphaned")
    try:
        echo = procs.spawn("echo", actors.Echo)
        with pytest.raises(SupervisionError, match="host agent") as info:
            echo.echo.call(1).get(timeout=T)
        assert "died" in str(info.value) and str(agent.pid) in str(info.value)
        wait_until(lambda: len(root_events) == 2, T, "an event per requested proc")
        assert {event.kind for event in root_events} == {"unreachable"}
    finally:
        procs.stop().get(timeout=T)
    with this_host().spawn_procs(per_host={"gpus": 1}) as again:  # a new agent serves
        assert again.spawn("echo", actors.Echo).echo.call_one(2).get(timeout=T) == 2


@pytest.mark.timeout(60)
def test_spawn_procs_on_a_dead_daemon_fails(
    make_daemon: Callable[[], DaemonAgent],  # noqa: F811
    root_events: list[Any],
) -> None:
    daemon = make_daemon()
    hosts = attach([daemon.start()])
    daemon.kill()
    for attempt in ("before the silence is noticed", "after it is noticed"):
        procs = hosts.spawn_procs(per_host={"gpus": 1}, name="lost")
        try:
            with pytest.raises(SupervisionError, match="host agent") as info:
                procs.spawn("echo", actors.Echo).echo.call_one(1).get(timeout=T)
            assert daemon.address in str(info.value), attempt
        finally:
            procs.stop().get(timeout=T)
    assert {event.kind for event in root_events} == {"unreachable"}
    assert len(root_events) == 2


# -- client scripts run in their own process ----------------------------------------------------

TESTS = os.path.dirname(os.path.abspath(__file__))


@contextlib.contextmanager
def client_home() -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR for a client script (short: longer ones are ignored); every
    meshvisor process under it is killed, and it is removed, afterwards, pass or fail."""
    home = Path(tempfile.mkdtemp(prefix="h", dir=RUN_BASE))
    try:
        yield home
    finally:
        for pid, _ in meshvisor_processes(str(home)):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(home, ignore_errors=True)


# -- 9: output nobody reads does not stop supervision ---------------------------------------------

UNDRAINED_CLIENT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import actors
    from mesh import this_host
    from supervision import SupervisionError

    procs = this_host().spawn_procs(per_host={{"gpus": 2}})
    procs.on_failure(lambda event: True)
    printer = procs.slice(gpus=0).spawn("printer", actors.Printer)
    where = procs.slice(gpus=1).spawn("where", actors.Where)
    pid = where.where.call_one().get(timeout=30)[0]
    for _ in range(4):  # far more than a pipe holds, and nobody reads our stdout
        printer.say.call_one("x" * 500_000, "").get(timeout=30)
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    try:
        where.where.call_one().get(timeout=30)
        print("RESULT answered", file=sys.stderr, flush=True)
    except SupervisionError as error:
        print("RESULT failed", time.monotonic() - started, file=sys.stderr, flush=True)
    except TimeoutError:
        print("RESULT timeout", file=sys.stderr, flush=True)
    procs.stop().get(timeout=30)
    print("STOPPED", file=sys.stderr, flush=True)
""")


@pytest.mark.timeout(90)
def test_undrained_stdout_does_not_stop_reaping(tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(UNDRAINED_CLIENT.format(tests=TESTS))
    with client_home() as home, open(tmp_path / "stderr", "w+") as stderr:
        client = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,  # never read
            stderr=stderr,
            env={**os.environ, "XDG_RUNTIME_DIR": str(home)},
        )
        try:
            wait_until(lambda: "STOPPED" in (tmp_path / "stderr").read_text(), 60, "the client")
        finally:
            client.kill()
            client.wait(T)
            client.stdout.close()  # type: ignore[union-attr]
        err = (tmp_path / "stderr").read_text()
    result = next(line.split() for line in err.splitlines() if line.startswith("RESULT"))
    assert result[1] == "failed", err
    assert float(result[2]) < 20, "the SIGKILL was noticed only when something else happened"
