"""Fail-fast at the client root, tested on real client processes (tests/scripts/).

Fail-fast raises in the client's main thread, so each scenario runs as its own client process
(`failfast_client.py SCENARIO`). The tests check its exit status, its output (the supervision
report on stderr, the scenario's RESULT line, that atexit handlers ran) and that no process of
the job (host agent, fork server, procs) survives it. Every client gets its own
``XDG_RUNTIME_DIR`` (a short temporary directory), so the run directory it leaves (or not) is
its own.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import failing_actors as fa
import pytest
from conftest import RUN_BASE
from polling import pid_alive, wait_until

from mesh.testing import SEES_DEATHS_EARLY

SCRIPT = Path(__file__).parent / "scripts" / "failfast_client.py"
RUN_TIMEOUT_S = 60.0
GONE_TIMEOUT_S = 5.0  # "within a couple of seconds", with room for a loaded machine


@pytest.fixture
def xdg() -> Iterator[Path]:
    """The client's own ``XDG_RUNTIME_DIR``: short (ipc socket paths are limited to 107
    bytes, and pytest's tmp_path is long), private, and removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="mvf-", dir=RUN_BASE))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def client_env(xdg: Path) -> dict[str, str]:
    env = dict(os.environ, XDG_RUNTIME_DIR=str(xdg))
    env.pop("MESHVISOR_LOG_LEVEL", None)
    return env


def run_dirs(xdg: Path) -> list[Path]:
    return sorted(xdg.glob("meshvisor-*"))


class Outcome:
    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.pids: list[int] = self._tagged("PIDS") or []
        self.procs: list[int] = self._tagged("PROCS") or []
        self.result: dict[str, Any] | None = self._tagged("RESULT")

    def _tagged(self, tag: str) -> Any:
        """The value of the last line tagged `tag`."""
        found = None
        for line in self.stdout.splitlines():
            if line.startswith(f"{tag} "):
                found = json.loads(line[len(tag) + 1 :])
        return found

    def __repr__(self) -> str:
        return f"<exit {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}>"


def run_client(xdg: Path, *args: str) -> Outcome:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=client_env(xdg),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=xdg,
    )
    outcome = Outcome(proc)
    assert outcome.pids, outcome  # the job came up (agent, fork server, procs)
    # Whatever happened, nothing of the job outlives the client, and nothing is left on disk.
    wait_until(
        lambda: not any(pid_alive(p) for p in outcome.pids),
        GONE_TIMEOUT_S,
        f"the job's processes {outcome.pids} to exit after the client",
    )
    assert run_dirs(xdg) == []
    return outcome


def assert_reports(outcome: Outcome, *fragments: str) -> None:
    """Uncaught: status 1, the traceback, then the report (root cause first), atexit ran."""
    assert outcome.returncode == 1, outcome
    err = outcome.stderr
    assert "Traceback (most recent call last)" in err, outcome
    assert "supervision.SupervisionError: " in err, outcome
    assert "Supervision report" in err and "Root cause: " in err, outcome
    assert err.index("Traceback") < err.index("Supervision report") < err.index("Root cause:")
    root = err[err.index("Root cause: ") :].splitlines()[0]
    for fragment in fragments:
        assert fragment in root, (fragment, root)
    assert "ATEXIT" in outcome.stdout.splitlines(), outcome


def signal_event(event: dict[str, Any], pid: int, signame: str = "SIGKILL") -> None:
    assert event["kind"] == "signal" and event["signal"] == signame
    assert event["mesh"] == "workers-actors" and event["rank"] == {"gpus": 1}  # the actor's
    assert event["pid"] == pid and event["host"] == socket.gethostname()
    for fragment in ('"workers-actors"', "{'gpus': 1}", str(pid), socket.gethostname(), signame):
        assert fragment in event["str"]


# -- caught ---------------------------------------------------------------------------------------


def test_blocked_get_raises_the_failure(xdg: Path) -> None:
    outcome = run_client(xdg, "blocked_get")
    assert outcome.returncode == 0, outcome
    result = outcome.result
    assert result is not None, outcome
    signal_event(result["event"], result["pid"])
    assert result["early"] is True  # at once, not when the wait times out
    assert result["survivor"] == 0
    assert "Supervision report" not in outcome.stderr  # caught: handled, no report


@pytest.mark.parametrize("region", ["sleep", "event_wait", "busy", "other_call", "pickling"])
def test_failure_interrupts_the_main_thread(xdg: Path, region: str) -> None:
    """With no call waiting on it, the failure is raised wherever the main thread is; a
    try/except SupervisionError around the region catches it and the program goes on."""
    outcome = run_client(xdg, "interrupt", region)
    assert outcome.returncode == 0, outcome
    assert outcome.result is not None, outcome
    assert outcome.result["type"] == "SupervisionError"
    assert outcome.result["early"] is True, "raised only when the wait ended on its own"
    signal_event(outcome.result["event"], outcome.procs[1])
    assert outcome.result["survivor"] == 0
    assert "Supervision report" not in outcome.stderr


@pytest.mark.parametrize("library", ["asyncio", "trio"])
def test_async_main_catches_a_failure_in_a_supervised_region(xdg: Path, library: str) -> None:
    """In an async main task, a failure during an unrelated await cancels the supervised()
    region and is raised at its end: try/except around it catches it, and handles it."""
    outcome = run_client(xdg, "async_caught", library)
    assert outcome.returncode == 0, outcome
    assert outcome.result is not None, outcome
    assert outcome.result["type"] == "SupervisionError"
    assert outcome.result["early"] is True, "raised only when the sleep ended on its own"
    signal_event(outcome.result["event"], outcome.procs[1])
    assert outcome.result["survivor"] == 0
    assert "Supervision report" not in outcome.stderr


@pytest.mark.parametrize("library", ["asyncio", "trio"])
def test_async_newest_supervised_region_takes_the_failure(xdg: Path, library: str) -> None:
    outcome = run_client(xdg, "async_nested", library)
    assert outcome.returncode == 0, outcome
    assert outcome.result == {"caught": ["inner"]}, outcome


@pytest.mark.parametrize("library", ["asyncio", "trio"])
def test_async_awaited_call_raises_its_failure_once(xdg: Path, library: str) -> None:
    outcome = run_client(xdg, "async_awaited", library)
    assert outcome.returncode == 0, outcome
    assert outcome.result is not None, outcome
    (raised,) = outcome.result["raised"]
    signal_event(raised, outcome.result["pid"])


# -- uncaught --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "fragments"),
    [
        ("sigkill", ["killed by SIGKILL", '"workers-actors"']),
        ("exit0", ["exited with code 0", '"workers-actors"']),
        ("broadcast_raise", ["failed with an exception", '"workers-actors"', "broadcast"]),
        ("hung", ["hung", "heartbeat"]),
    ],
)
def test_uncaught_failure_ends_the_program(xdg: Path, kind: str, fragments: list[str]) -> None:
    outcome = run_client(xdg, "uncaught", kind)
    assert_reports(outcome, *fragments, "{'gpus': 1}", str(outcome.procs[1]), socket.gethostname())
    assert outcome.result is None  # the sleep never finished
    if kind == "broadcast_raise":  # the remote traceback is part of the report
        assert "EndpointError: nobody hears this" in outcome.stderr
    if kind == "hung":  # its stacks, dumped before it was killed, follow the root cause
        report = outcome.stderr[outcome.stderr.index("Root cause: ") :]
        assert "Python stacks of its threads (the most relevant first):" in report
        assert "stacks were dumped" in report.splitlines()[0]


@pytest.mark.parametrize("library", ["asyncio", "trio"])
@pytest.mark.parametrize("scoped", ["plain", "scoped"])
def test_async_main_uncaught_failure_ends_the_program(xdg: Path, library: str, scoped: str) -> None:
    outcome = run_client(xdg, "async_uncaught", library, scoped)
    assert_reports(outcome, "killed by SIGKILL", "{'gpus': 1}", str(outcome.procs[1]))
    assert outcome.result is None  # the sleep never finished


def test_uncaught_failure_of_the_awaited_call(xdg: Path) -> None:
    outcome = run_client(xdg, "uncaught_in_get")
    assert_reports(outcome, "killed by SIGSEGV", "{'gpus': 0}", str(outcome.procs[0]))
    assert "segfault.call_one().get(" in outcome.stderr  # raised by the get() itself
    report = outcome.stderr[outcome.stderr.index("Root cause: ") :]
    assert "Fatal Python error: Segmentation fault" in report  # the native fault's stack
    assert report.index("Current thread") < report.index("in segfault")


def test_uncaught_actor_error_shows_the_remote_traceback(xdg: Path) -> None:
    """A program that dies of an ActorError prints where the endpoint raised, not only where
    the caller waited for it."""
    outcome = run_client(xdg, "uncaught_actor_error")
    assert outcome.returncode == 1, outcome
    err = outcome.stderr
    assert ".raise_error.call_one(" in err, outcome  # the caller's own traceback
    assert "EndpointError: no such input" in err, outcome
    remote = err[err.index("Remote traceback (process ") :]
    assert str(outcome.procs[1]) in remote.splitlines()[0], outcome
    source = Path(fa.__file__).read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "raise EndpointError(message)" in text)
    assert f'failing_actors.py", line {line}, in raise_error' in remote, outcome
    assert "Supervision report" not in err, outcome  # an ActorError is no supervision failure
    assert "ATEXIT" in outcome.stdout.splitlines(), outcome


def test_escalated_failure_report_shows_the_path(xdg: Path) -> None:
    outcome = run_client(xdg, "escalated", str(xdg / "record.jsonl"))
    assert_reports(outcome, '"leaf"', "killed by SIGKILL")  # the actor mesh on level3
    err = outcome.stderr
    report = err[err.index("Supervision report") :]
    assert "Propagated up the tree:" in report
    path = report[report.index("Propagated up the tree:") :]
    assert path.index('"owner2"') < path.index('"owner1"')  # bottom-up, after the root cause
    levels = [json.loads(line)["level"] for line in (xdg / "record.jsonl").read_text().splitlines()]
    assert levels == [2, 1]  # both owners were asked, once each, bottom-up


# -- opting out of fail-fast ------------------------------------------------------------------


def test_unhandled_failure_hook_handles(xdg: Path) -> None:
    outcome = run_client(xdg, "hook", "handle")
    assert outcome.returncode == 0, outcome
    assert outcome.result is not None
    (event,) = outcome.result["events"]
    signal_event(event, outcome.procs[1])
    assert outcome.result["survivor"] == 0
    assert "ATEXIT" in outcome.stdout


def test_unhandled_failure_hook_that_declines_keeps_fail_fast(xdg: Path) -> None:
    outcome = run_client(xdg, "hook", "decline")
    hooked = [line for line in outcome.stdout.splitlines() if line.startswith("HOOK ")]
    assert len(hooked) == 1, outcome
    signal_event(json.loads(hooked[0][5:]), outcome.procs[1])
    assert_reports(outcome, "killed by SIGKILL", str(outcome.procs[1]))


@pytest.mark.parametrize(
    ("decision", "order"),
    [
        ("handle", ["mesh:signal"]),
        ("ignore", ["mesh:signal", "hook:signal"]),
        ("raise", ["mesh:signal", "hook:signal"]),
    ],
)
def test_mesh_handler_decides_before_the_hook(xdg: Path, decision: str, order: list[str]) -> None:
    outcome = run_client(xdg, "on_failure", decision)
    assert outcome.returncode == 0, outcome
    assert outcome.result == {"order": order, "survivor": 0}  # rank 0 of its slice
    if decision == "raise":  # a broken handler is reported, not swallowed
        assert "the mesh handler broke" in outcome.stderr


# -- losing the agent or the client -------------------------------------------------------------


def test_agent_loss_makes_its_procs_unreachable(xdg: Path) -> None:
    outcome = run_client(xdg, "agent_killed")
    assert outcome.returncode == 0, outcome
    result = outcome.result
    assert result is not None, outcome
    events = result["events"]
    assert sorted(e["rank"]["gpus"] for e in events) == [0, 1], "each rank once"
    assert {e["kind"] for e in events} == {"unreachable"}
    assert all(e["mesh"] == "workers-actors" for e in events)
    assert all(str(result["agent"]) in e["str"] for e in events)
    assert result["later_call"] == "unreachable"
    assert result["respawned"] == [0, 1]  # a new agent serves new procs
    assert result["early"] is True, "raised only when the wait ended on its own"


def test_client_sigkill_takes_the_whole_job_down(xdg: Path) -> None:
    client = subprocess.Popen(
        [sys.executable, str(SCRIPT), "client_killed"],
        env=client_env(xdg),
        cwd=xdg,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        pids = _read_pids(client)
        # The host agent, its fork server, the fork server's death waiter (where the kernel
        # has futex_waitv) and the two procs, all up (the waiter must go too).
        assert len(pids) == 4 + SEES_DEATHS_EARLY, [(p, _cmdline(p)) for p in pids]
        assert all(pid_alive(p) for p in pids), [(p, pid_alive(p)) for p in pids]
        assert client.poll() is None  # still sleeping: it is SIGKILL that ends it
        client.kill()
        assert client.wait(timeout=RUN_TIMEOUT_S) == -9
        wait_until(
            lambda: not any(pid_alive(p) for p in pids),
            GONE_TIMEOUT_S,
            f"the job's processes {pids} to exit after the client was SIGKILLed",
        )
        wait_until(lambda: run_dirs(xdg) == [], GONE_TIMEOUT_S, "the run directory to be removed")
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        assert client.stdout is not None
        client.stdout.close()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "(gone)"


def _read_pids(client: subprocess.Popen[bytes]) -> list[int]:
    """The PIDS line of a running client (unbuffered reads: no line may hide in a buffer)."""
    assert client.stdout is not None
    fd = client.stdout.fileno()
    selector = selectors.DefaultSelector()
    selector.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    received = b""
    try:
        while time.monotonic() < deadline:
            if not selector.select(deadline - time.monotonic()):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            received += chunk
            for line in received.decode().splitlines(keepends=True):
                if line.startswith("PIDS ") and line.endswith("\n"):
                    return list(json.loads(line[5:]))
    finally:
        selector.close()
    raise AssertionError(f"the client never printed its pids (exit {client.poll()}): {received!r}")
