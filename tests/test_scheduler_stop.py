"""A host agent stopped the way a scheduler stops a job step (``scancel``: SIGTERM to every
process of the step, the agent, its fork server and its procs, at once) ends with exit status 0
and leaves nothing, and the owners of its procs hear that they are gone: they did not ask."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import actors
import pytest
from polling import wait_until

from mesh import attach
from supervision import SupervisionEvent

pytestmark = pytest.mark.timeout(120)

T = 30.0


@pytest.fixture
def step_agent(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """An agent in a process group of its own, as a SLURM job step's processes are."""
    address_file = tmp_path / "address"
    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "meshvisor", "agent", "--listen", f"ipc://{tmp_path}/agent"),
            *("--rundir", str(rundir), "--address-file", str(address_file)),
        ],
        start_new_session=True,
    )
    try:
        wait_until(address_file.exists, T, "the agent to listen")
        agent.address = address_file.read_text().strip()  # type: ignore[attr-defined]
        yield agent
    finally:
        _kill_group(agent.pid)
        agent.wait(T)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _group_is_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sigterm_to_the_whole_step_ends_the_agent_with_status_0_and_owners_hear_of_it(
    step_agent: subprocess.Popen[bytes],
) -> None:
    procs = attach([step_agent.address]).spawn_procs(per_host={"gpus": 2}, name="stepped")
    heard: list[SupervisionEvent] = []
    echo = procs.spawn("echo", actors.Echo)
    echo.on_failure(lambda event: heard.append(event) or True)
    assert sorted(echo.echo.call(1).get(timeout=T).values()) == [1, 1]
    os.killpg(step_agent.pid, signal.SIGTERM)  # what slurmstepd does at scancel
    assert step_agent.wait(T) == 0
    wait_until(lambda: _group_is_gone(step_agent.pid), T, "every process of the step to end")
    wait_until(lambda: len(heard) == 2, T, "an event for each rank")
    assert {event.kind for event in heard} <= {"unreachable", "signal"}
