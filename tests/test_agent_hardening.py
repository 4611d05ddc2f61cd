"""Host agents under hostile or careless input: dead agents, undrained output, wrongly typed
messages, large requests, long names, full disks and stale bookkeeping.

Every test uses real agents, procs and sockets. Failures that reach the client are recorded by
the `root_events` fixture (so they never interrupt pytest) and looked at where they matter.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import actors
import pytest
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
