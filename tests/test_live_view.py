"""``meshvisor top``: the live supervision tree, driven in a real terminal (tmux) as a person
would, against real agents and procs: what it shows, how it changes when a proc dies, q to
quit, read-only attach to a persistent allocation, the ``--json`` form and clear errors."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from actors import Where
from conftest import RUN_BASE
from polling import wait_until
from tmux_pane import TmuxPane, tmux_pane

from mesh import BootstrapCommand
from supervision import RestartPolicy
from transport import KEYS_ENV, CurveKeys

pytestmark = pytest.mark.timeout(240)
T = 60.0
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def _env(**extra: str) -> dict[str, str]:
    """What the view's process needs: this checkout first on its path, this session's base."""
    env = {"PYTHONPATH": ROOT, "XDG_RUNTIME_DIR": RUN_BASE, **extra}
    if KEYS_ENV in os.environ and KEYS_ENV not in extra:
        env[KEYS_ENV] = os.environ[KEYS_ENV]
    return env


def _top(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshvisor", "top", *args]


def _run_top(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **(env or _env())}
    return subprocess.run(_top(*args), env=environment, capture_output=True, text=True, timeout=T)


@pytest.fixture
def pane() -> Iterator[TmuxPane]:
    with tmux_pane() as made:
        yield made


def _both_actors(screen: str) -> bool:
    return screen.count("└ watchers{") == 2


def _quit(pane: TmuxPane) -> None:
    pane.press("q")
    wait_until(pane.command_ended, T, "the view to end after q")


# -- a running client: this test process ---------------------------------------------------


def test_view_shows_procs_and_actors_then_a_kill_then_q_quits(
    pane: TmuxPane, make_procs: Callable[..., Any], root_events: list[Any]
) -> None:
    procs = make_procs({"gpus": 2}, name="view-kill")
    where = procs.spawn("watchers", Where)
    pids = sorted(pid for pid, _ in where.where.call().get(timeout=T).values())
    pane.start(_top("--pid", str(os.getpid()), "--mesh", "view-kill", "--interval", "0.5"), _env())
    shown = pane.wait_for(
        lambda s: all(str(p) in s for p in pids) and _both_actors(s),
        "both procs, their pids and the actor mesh",
    )
    assert f"client {os.getpid()}" in shown
    assert "running" in shown and "view-kill{gpus=0}" in shown and "view-kill{gpus=1}" in shown
    assert "host " in shown and "last events" in shown and "spawned" in shown

    os.kill(pids[1], signal.SIGKILL)
    shown = pane.wait_for(lambda s: "killed by SIGKILL" in s, "the kill to show")
    assert "failed" in shown
    wait_until(lambda: root_events, T, "the failure to reach the client")
    root_events.clear()
    _quit(pane)


def test_long_reasons_never_hide_which_proc_is_which(
    pane: TmuxPane, make_procs: Callable[..., Any], root_events: list[Any]
) -> None:
    command = BootstrapCommand("sh", args=("-c", "exit 3; " + "x" * 300))
    make_procs({"gpus": 1}, name="view-long", bootstrap_command=command)  # a long reason
    wait_until(lambda: root_events, T, "the failed start to reach the client")
    root_events.clear()
    where = make_procs({"gpus": 2}, name="view-short").spawn("watchers", Where)
    pids = sorted(pid for pid, _ in where.where.call().get(timeout=T).values())
    meshes = ("--mesh", "view-long", "--mesh", "view-short")
    pane.start(_top("--pid", str(os.getpid()), *meshes, "--interval", "0.5"), _env(), width=120)
    shown = pane.wait_for(lambda s: all(str(p) in s for p in pids), "both pids beside the reason")
    assert "failed to start: the bootstrap command" in shown and "…" in shown  # the reason, cut
    _quit(pane)


def test_json_snapshot_has_the_documented_shape(make_procs: Callable[..., Any]) -> None:
    procs = make_procs({"gpus": 2}, name="view-json")
    where = procs.spawn("watchers", Where)
    pids = {pid for pid, _ in where.where.call().get(timeout=T).values()}

    def snapshot() -> dict[str, Any]:
        done = _run_top("--pid", str(os.getpid()), "--mesh", "view-json", "--json")
        assert done.returncode == 0, done.stderr
        found: dict[str, Any] = json.loads(done.stdout)
        return found

    wait_until(lambda: _actors_reported(snapshot(), 2), T, "the actors to be reported")
    found = snapshot()
    assert found["schema"] == "meshvisor.top/1" and found["unreachable"] == []
    (host,) = found["hosts"]
    assert set(host) == {"host", "agent", "agent_pid", "agent_started", "time", "procs", "events"}
    live = [proc for proc in host["procs"] if proc["pid"] in pids]
    assert sorted(proc["point"]["gpus"] for proc in live) == [0, 1]
    for proc in live:
        assert proc["health"] == "running" and proc["restarts"] == 0 and proc["exit"] is None
        assert proc["rss_bytes"] > 0 and proc["ended"] is None
        assert proc["cpu_percent"] is None or proc["cpu_percent"] >= 0
        (actor,) = proc["actors"]
        assert actor["mesh"] == "watchers" and actor["state"] == "running"
        assert actor["point"] == proc["point"]
    kinds = {event["kind"] for event in host["events"]}
    assert {"spawned", "actor_started"} <= kinds


def _actors_reported(snapshot: dict[str, Any], count: int) -> bool:
    procs = [p for host in snapshot["hosts"] for p in host["procs"] if p["health"] == "running"]
    return sum(len(p["actors"]) for p in procs) >= count


def _json_of_this_client() -> dict[str, Any]:
    done = _run_top("--pid", str(os.getpid()), "--json")
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def _procs_of(snapshot: dict[str, Any], mesh: str) -> list[dict[str, Any]]:
    return [p for host in snapshot["hosts"] for p in host["procs"] if p["mesh"] == mesh]


def test_a_restarted_rank_shows_its_restarts(make_procs: Callable[..., Any]) -> None:
    procs = make_procs(
        {"gpus": 1}, name="view-restarting", restart=RestartPolicy(max_restarts=3, within_s=60)
    )
    where = procs.spawn("watchers", Where)
    ((pid, _),) = where.where.call().get(timeout=T).values()
    os.kill(pid, signal.SIGKILL)

    def restarted() -> dict[str, Any] | None:
        snapshot = _json_of_this_client()
        live = [p for p in _procs_of(snapshot, "view-restarting") if p["health"] == "running"]
        if live and live[0]["restarts"] == 1 and live[0]["actors"]:
            return snapshot
        return None

    wait_until(restarted, T, "the re-spawned proc with its rebuilt actor")
    snapshot = restarted()
    assert snapshot is not None
    ended, live = sorted(
        _procs_of(snapshot, "view-restarting"), key=lambda p: p["health"] != "failed"
    )
    assert (
        ended["pid"] == pid and ended["health"] == "failed" and ended["exit"] == "killed by SIGKILL"
    )
    (actor,) = live["actors"]
    assert actor["restarts"] == 1 and actor["state"] == "running"
    messages = [e["message"] for host in snapshot["hosts"] for e in host["events"]]
    assert f"spawned, replacing {ended['proc_id']} (restart 1)" in messages


def _health_of(mesh: str) -> list[tuple[str, str | None]]:
    return [(p["health"], p["exit"]) for p in _procs_of(_json_of_this_client(), mesh)]


def test_a_paused_proc_shows_as_hung_then_killed_as_hung(
    make_procs: Callable[..., Any], root_events: list[Any]
) -> None:
    procs = make_procs(
        {"gpus": 1}, name="view-pausing", heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0
    )
    where = procs.spawn("watchers", Where)
    ((pid, _),) = where.where.call().get(timeout=T).values()
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: _health_of("view-pausing")[0][0] == "hung", T, "the paused proc: hung")
        wait_until(
            lambda: (_health_of("view-pausing")[0][1] or "").startswith("hung, killed"),
            T,
            "its kill",
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    wait_until(lambda: root_events, T, "the failure to reach the client")
    root_events.clear()


# -- a persistent allocation, attached to read-only ----------------------------------------

CLIENT = """
import sys, time
sys.path.insert(0, {tests!r})
from actors import Where
from mesh import attach
procs = attach({alloc!r}).spawn_procs(per_host={{"gpus": 2}})
where = procs.spawn("watchers", Where)
print(" ".join(str(pid) for pid, _ in where.where.call().get().values()), flush=True)
time.sleep(600)
"""


@pytest.fixture
def allocation(tmp_path: Path) -> Iterator[Path]:
    """A daemon agent on tcp in an allocation file, with CURVE keys made for it (no
    MESHVISOR_CURVE_KEYS: whoever attaches finds them beside the file)."""
    alloc = tmp_path / "hosts"
    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != KEYS_ENV}
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"),
            *("--rundir", str(rundir), "--allocation", str(alloc), "--owner-timeout", "1"),
        ],
        env={**env, "PYTHONPATH": ROOT},
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: alloc.exists() and alloc.read_text().strip(), T, "the agent to join")
        yield alloc
    finally:
        agent.terminate()
        agent.wait(T)


def test_read_only_view_of_a_persistent_allocation_outlives_its_client(
    pane: TmuxPane, allocation: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != KEYS_ENV}
    script = CLIENT.format(tests=TESTS, alloc=str(allocation))
    client = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        env={**env, "PYTHONPATH": ROOT},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert client.stdout is not None
        pids = [int(pid) for pid in client.stdout.readline().split()]
        assert len(pids) == 2, "the client did not start its procs"
        pane.start(
            _top("--allocation", str(allocation), "--interval", "0.5"), _env(**{KEYS_ENV: ""})
        )
        pane.wait_for(
            lambda s: all(str(p) in s for p in pids) and _both_actors(s),
            "the client's procs and actors, running",
        )
        client.send_signal(signal.SIGKILL)
        client.wait(T)
        # the viewer is no owner: the agent stops the orphans once their owner is silent
        shown = pane.wait_for(
            lambda s: s.count("stopped (killed by SIGKILL)") >= 2, "the orphans to be stopped"
        )
        assert all(str(p) in shown for p in pids)
        _quit(pane)
    finally:
        client.kill()
        client.wait(T)
        if client.stdout is not None:
            client.stdout.close()
        _remove_run_dir_of(client.pid)  # killed, the client could not


def _remove_run_dir_of(pid: int) -> None:
    for owner in Path(RUN_BASE).glob("meshvisor-*/owner.pid"):
        if owner.read_text().strip() == str(pid):
            shutil.rmtree(owner.parent, ignore_errors=True)


def test_an_agent_with_other_keys_refuses_the_view_and_it_says_so(
    allocation: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other-keys"
    CurveKeys.create(other)
    (agent,) = allocation.read_text().split()
    done = _run_top(
        "--agent", agent, "--json", "--timeout", "3", env=_env(**{KEYS_ENV: str(other)})
    )
    assert done.returncode == 1
    (unreachable,) = json.loads(done.stdout)["unreachable"]
    assert unreachable["agent"] == agent and "refused this viewer" in unreachable["reason"]
    done = _run_top("--allocation", str(allocation), "--json", env=_env(**{KEYS_ENV: ""}))
    assert done.returncode == 0, done.stderr  # with the allocation's own keys, it answers


# -- clear errors ---------------------------------------------------------------------------


def test_unknown_targets_are_named_with_what_to_do(tmp_path: Path) -> None:
    done = _run_top("--allocation", str(tmp_path / "no-such-allocation"), "--json")
    assert (
        done.returncode == 2 and "no allocation" in done.stderr and "meshvisor agent" in done.stderr
    )
    done = _run_top("--pid", "999999999", "--json")
    assert done.returncode == 2 and "no running client with pid 999999999" in done.stderr
    done = _run_top("--slurm-job", "4242", "--job-dir", str(tmp_path), "--json")
    assert done.returncode == 2 and "no meshvisor SLURM job" in done.stderr
    done = _run_top("--agent", "localhost:5555", "--json")
    assert done.returncode == 2 and "not an agent address" in done.stderr


def test_unreachable_agents_are_listed_with_the_reason(tmp_path: Path) -> None:
    gone = f"ipc://{tmp_path}/no-agent"
    done = _run_top("--agent", gone, "--agent", "tcp://127.0.0.1:9", "--json", "--timeout", "1")
    assert done.returncode == 1
    found = json.loads(done.stdout)
    assert found["hosts"] == []
    reasons = {u["agent"]: u["reason"] for u in found["unreachable"]}
    assert "no agent listens there" in reasons[gone]
    assert "no answer in time" in reasons["tcp://127.0.0.1:9"]
    assert f"unreachable {gone}" in done.stderr


def test_a_view_left_running_costs_nothing_when_its_process_is_gone(pane: TmuxPane) -> None:
    """Closing the terminal (SIGHUP) still removes the view's private run directory."""
    pane.start(
        _top("--agent", f"ipc://{RUN_BASE}/no-agent", "--interval", "0.2", "--timeout", "0.2"),
        _env(),
    )
    pane.wait_for(lambda s: "unreachable" in s, "the view to show the unreachable agent")
    wait_until(lambda: list(Path(RUN_BASE).glob("meshvisor-view-*")), T, "its run directory")
    pane.tmux("kill-server")
    wait_until(
        lambda: not list(Path(RUN_BASE).glob("meshvisor-view-*")), T, "its run dir to be removed"
    )
