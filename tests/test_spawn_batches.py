"""Spawning many procs at once: an agent hands all the procs of one request to its fork server
in one batch. A rank that cannot start fails alone; a slow fork server delays the batch, and
calls made meanwhile still end."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from actors import Echo
from failing_actors import refuse_rank_two
from test_agent_hardening import local_agent, raw_peer

from mesh.testing import wire
from supervision import SupervisionError
from transport import encode

T = 30.0  # the bound on every wait (never reached when things work)


@pytest.mark.timeout(60)
def test_one_rank_of_a_batch_that_cannot_start_fails_alone(
    make_procs: Callable[..., Any], root_events: list[Any]
) -> None:
    echo = make_procs({"gpus": 4}, bootstrap=refuse_rank_two).spawn("echo", Echo)
    pids = {rank: echo.slice(gpus=rank).pid.call_one().get(timeout=T) for rank in (0, 1, 3)}
    assert len(set(pids.values())) == 3
    with pytest.raises(SupervisionError) as caught:
        echo.slice(gpus=2).pid.call_one().get(timeout=T)
    event = caught.value.event
    assert (event.kind, event.rank.rank) == ("spawn_failed", 2)
    assert "refuse_rank_two raised RuntimeError: rank 2 has no GPU" in str(event.message)
    assert echo.slice(gpus=3).pid.call_one().get(timeout=T) == pids[3]  # the others go on
    assert root_events and {e.rank.rank for e in root_events} == {2}
    root_events.clear()


@pytest.mark.timeout(60)
def test_an_agent_refuses_one_proc_of_a_batch_and_starts_the_others() -> None:
    """Two procs of one request share an id: the agent forks the first and refuses the
    second, saying why (a raw request plays a client that made a mistake)."""
    address, _ = local_agent()
    specs = tuple(wire.ProcSpec("batch-twin-0", "twins", ("gpus",), (2,), r) for r in (0, 1))
    with raw_peer(address) as peer:
        owner = peer.inbox.address
        cwd = os.getcwd()
        peer.send(encode(wire.SpawnProcs(owner, specs, (), tuple(sys.path), cwd, 0.25, 5.0)))
        heard = _receive(peer.inbox, {wire.SpawnFailed, wire.ProcReady})
        assert heard[wire.SpawnFailed].proc_id == "batch-twin-0"
        assert "a proc with this id runs already" in heard[wire.SpawnFailed].reason
        ready = heard[wire.ProcReady]
        assert ready.proc_id == "batch-twin-0" and ready.pid != os.getpid()
        stopped = peer.answer(wire.StopProcs(("batch-twin-0",), 0.0, owner)).header
        assert type(stopped) is wire.ProcExited and stopped.pid == ready.pid


def _receive(inbox: Any, kinds: set[type]) -> dict[type, Any]:
    """The first message of each of `kinds` that comes to `inbox` (others are skipped)."""
    heard: dict[type, Any] = {}
    deadline = time.monotonic() + T
    while set(heard) != kinds:
        assert time.monotonic() < deadline, f"heard only {heard}"
        if inbox.poll(100) and (envelope := inbox.receive_nowait()) is not None:
            heard.setdefault(type(envelope.header), envelope.header)
    return heard


def _fork_server_of(agent_pid: int) -> int:
    (child,) = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    return int(child)


@pytest.mark.timeout(60)
def test_a_batch_waits_for_a_slow_fork_server_and_then_starts_whole(
    make_procs: Callable[..., Any], no_failure_reaches_the_root: None
) -> None:
    server = _fork_server_of(local_agent()[1])
    os.kill(server, signal.SIGSTOP)  # as slow as can be, until continued
    try:
        procs = make_procs({"gpus": 4}, heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5)
        calling = procs.spawn("echo", Echo).pid.call()
        with pytest.raises(TimeoutError):
            calling.get(timeout=0.5)  # a call ends even while its procs cannot start
    finally:
        os.kill(server, signal.SIGCONT)
    pids = calling.get(timeout=T).values()
    assert len(set(pids)) == 4
