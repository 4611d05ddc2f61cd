"""Procs started by a bootstrap command (another Python, a wrapper script) instead of a fork:
they join the mesh like forked procs, and a command that cannot start fails with its name."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from actors import Echo
from hypothesis import given
from hypothesis import strategies as st

from mesh import BootstrapCommand, current_rank, this_host
from supervision import RestartPolicy, SupervisionError

CALL_TIMEOUT_S = 60.0


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_procs_run_with_the_given_python() -> None:
    hosts = this_host().with_python_executable(sys.executable)
    launched = hosts.spawn_procs(per_host={"gpus": 2}, name="launched")
    try:
        echo = launched.spawn("echo", Echo)
        pids = echo.pid.call().get(timeout=CALL_TIMEOUT_S).values()
        assert len(set(pids)) == 2
        for pid in pids:  # a fresh interpreter running the proc entry point, not a fork
            assert "mesh.bootstrap_main" in _cmdline(pid)
        assert echo.echo.call("hi").get(timeout=CALL_TIMEOUT_S).values() == ("hi", "hi")
    finally:
        launched.stop().get(timeout=CALL_TIMEOUT_S)


def test_a_wrapper_script_sets_what_the_actor_sees(
    make_procs: Callable[..., Any], tmp_path: Path
) -> None:
    wrapper = tmp_path / "wrapper.sh"
    wrapper.write_text('#!/bin/sh\nexport MV_WRAPPED="by the wrapper"\nexec "$@"\n')
    wrapper.chmod(0o700)
    command = BootstrapCommand(
        str(wrapper),
        args=(sys.executable, "-m", "mesh.bootstrap_main"),
        env={"MV_FROM_COMMAND": "by the command"},
    )
    procs = make_procs({"gpus": 2}, bootstrap_command=command)
    echo = procs.spawn("echo", Echo)
    assert (
        echo.getenv.call("MV_WRAPPED").get(timeout=CALL_TIMEOUT_S).values()
        == ("by the wrapper",) * 2
    )
    assert (
        echo.getenv.call("MV_FROM_COMMAND").get(timeout=CALL_TIMEOUT_S).values()
        == ("by the command",) * 2
    )


def test_a_launched_proc_is_supervised_and_respawned_the_same_way(
    make_procs: Callable[..., Any], root_events: list[Any]
) -> None:
    procs = make_procs({"gpus": 2}, bootstrap_command=BootstrapCommand.python(sys.executable))
    echo = procs.spawn("echo", Echo)
    victim = echo.slice(gpus=1)
    pid = victim.pid.call_one().get(timeout=CALL_TIMEOUT_S)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(SupervisionError, match="SIGKILL"):
        victim.echo.call_one("late").get(timeout=CALL_TIMEOUT_S)
    assert echo.slice(gpus=0).echo.call_one("alive").get(timeout=CALL_TIMEOUT_S) == "alive"
    root_events.clear()
    procs.respawn([1]).get(timeout=CALL_TIMEOUT_S)
    new_pid = victim.pid.call_one().get(timeout=CALL_TIMEOUT_S)
    assert new_pid != pid
    assert "mesh.bootstrap_main" in _cmdline(new_pid)  # the re-spawn uses the command too


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (BootstrapCommand("/nonexistent/python3"), "'/nonexistent/python3' cannot be run"),
        (BootstrapCommand("no-such-program-mv"), "no executable file of that name on PATH"),
        (BootstrapCommand("sh", args=("-c", "exit 3")), "exited with code 3 before its proc"),
        (BootstrapCommand("sh", args=("-c", "kill -9 $$")), "killed by SIGKILL before its proc"),
    ],
)
def test_a_command_that_cannot_start_fails_its_ranks_naming_it(
    make_procs: Callable[..., Any], root_events: list[Any], command: BootstrapCommand, expected: str
) -> None:
    procs = make_procs({"gpus": 1}, bootstrap_command=command)
    echo = procs.spawn("echo", Echo)
    with pytest.raises(SupervisionError, match="could not be spawned") as info:
        echo.echo.call_one("x").get(timeout=CALL_TIMEOUT_S)
    assert expected in str(info.value)
    assert command.program in str(info.value)
    root_events.clear()


def test_a_command_that_never_connects_is_killed_and_named(
    make_procs: Callable[..., Any], root_events: list[Any]
) -> None:
    command = BootstrapCommand("sleep", args=("600",))
    procs = make_procs({"gpus": 1}, bootstrap_command=command, heartbeat_timeout_s=0.5)
    echo = procs.spawn("echo", Echo)
    with pytest.raises(SupervisionError, match="'sleep 600' never connected") as info:
        echo.echo.call_one("x").get(timeout=CALL_TIMEOUT_S)
    assert "was killed" in str(info.value)
    root_events.clear()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"program": ""}, "not a command"),
        ({"program": "python3", "args": "-m x"}, "args a list of str"),
        ({"program": "python3", "args": ("a\0b",)}, "without NUL"),
        ({"program": "python3", "env": {"A=B": "1"}}, "cannot be set"),
        ({"program": "python3", "env": {"A": 1}}, "cannot be set"),
    ],
)
def test_bad_commands_are_refused_when_made(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BootstrapCommand(**kwargs)


def test_a_bootstrap_command_must_be_one() -> None:
    with pytest.raises(TypeError, match="must be a BootstrapCommand"):
        this_host().spawn_procs(per_host={"gpus": 1}, bootstrap_command="python3")  # type: ignore[arg-type]


@given(
    program=st.text(min_size=1, max_size=8),
    arg0=st.none() | st.text(max_size=8),
    args=st.lists(st.text(max_size=8), max_size=4),
)
def test_a_command_is_kept_as_given_or_refused(
    program: str, arg0: str | None, args: list[str]
) -> None:
    strings = [program, *args, *([arg0] if arg0 is not None else [])]
    if any("\0" in s for s in strings):
        with pytest.raises(ValueError):
            BootstrapCommand(program, arg0, args)
        return
    command = BootstrapCommand(program, arg0, args)
    assert command.argv() == (program, arg0 or program, *args)


def test_the_entry_point_run_by_hand_says_what_it_needs() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MESHVISOR_PROC_CONFIG"}
    done = subprocess.run(
        [sys.executable, "-m", "mesh.bootstrap_main"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "started by a host agent's bootstrap command" in done.stderr


# -- bootstrap functions ------------------------------------------------------------------------


LOCK = threading.Lock()


def mark_bootstrapped() -> None:
    """A bootstrap function: leaves a mark in the proc that its actors can see."""
    os.environ["MV_BOOTSTRAPPED"] = f"rank {dict(current_rank())}"


async def mark_bootstrapped_async() -> None:
    await asyncio.sleep(0)
    os.environ["MV_BOOTSTRAPPED"] = "async"


def refuse_to_bootstrap() -> None:
    raise ValueError("no GPU here")


@pytest.mark.parametrize(
    ("function", "marks"),
    [
        (mark_bootstrapped, ("rank {'gpus': 0}", "rank {'gpus': 1}")),
        (mark_bootstrapped_async, ("async", "async")),
    ],
    ids=["sync", "async"],
)
def test_a_bootstrap_function_runs_in_each_proc_before_its_actors(
    make_procs: Callable[..., Any], function: Callable[[], Any], marks: tuple[str, ...]
) -> None:
    procs = make_procs({"gpus": 2}, bootstrap=function)
    echo = procs.spawn("echo", Echo)
    assert echo.getenv.call("MV_BOOTSTRAPPED").get(timeout=CALL_TIMEOUT_S).values() == marks


def test_a_bootstrap_function_runs_in_launched_and_respawned_procs(
    make_procs: Callable[..., Any],
) -> None:
    procs = make_procs(
        {"gpus": 1},
        bootstrap=mark_bootstrapped,
        bootstrap_command=BootstrapCommand.python(sys.executable),
        restart=RestartPolicy(max_restarts=3, within_s=60),
    )
    echo = procs.spawn("echo", Echo)
    (pid,) = echo.pid.call().get(timeout=CALL_TIMEOUT_S).values()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while True:
        try:
            (new_pid,) = echo.pid.call().get(timeout=CALL_TIMEOUT_S).values()
        except SupervisionError:  # the call in flight when it died
            new_pid = pid
        if new_pid != pid or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert new_pid != pid
    assert echo.getenv.call("MV_BOOTSTRAPPED").get(timeout=CALL_TIMEOUT_S).values() == (
        "rank {'gpus': 0}",
    )


def test_a_bootstrap_function_that_raises_fails_its_ranks_saying_why(
    make_procs: Callable[..., Any], root_events: list[Any]
) -> None:
    procs = make_procs({"gpus": 1}, bootstrap=refuse_to_bootstrap)
    echo = procs.spawn("echo", Echo)
    with pytest.raises(SupervisionError) as caught:
        echo.pid.call().get(timeout=CALL_TIMEOUT_S)
    event = caught.value.event
    assert event.kind == "spawn_failed"
    assert "the bootstrap function refuse_to_bootstrap raised ValueError: no GPU here" in str(
        event.message
    )
    assert 'raise ValueError("no GPU here")' in str(event.message)  # with its traceback
    root_events.clear()


@pytest.mark.parametrize(
    ("bootstrap", "message"),
    [
        ("setup.sh", "must be a function"),
        (BootstrapCommand.python(sys.executable), "bootstrap_command="),
        (functools.partial(print, LOCK), "cannot be pickled"),
    ],
    ids=["a string", "a command", "unpicklable"],
)
def test_a_bootstrap_that_is_not_a_picklable_function_is_refused(
    bootstrap: Any, message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        this_host().spawn_procs({"gpus": 1}, bootstrap=bootstrap)
