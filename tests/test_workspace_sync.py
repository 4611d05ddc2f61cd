"""Workspace sync onto real host agents: two daemons in separate run directories (two hosts),
and one in a network namespace where the machine allows it. Procs import the synced code,
see changes after a reload or a restart, and only changed files travel."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RUN_BASE
from hypothesis import given
from hypothesis import strategies as st
from polling import wait_until
from test_netns import namespace as namespace  # the fixture
from workspace_actors import Importer

from mesh import WorkspaceError, WorkspaceSync, attach
from mesh.testing import workspace_path_problem
from mesh.testing import workspace_wire as ws
from transport import Inbox, Outbox, close_context, encode, new_context

T = 60.0
#: The largest file a workspace takes (docs/workspace-sync.md).
MAX_FILE_BYTES = 2 << 30


def _start_agents(folder: Path, count: int) -> tuple[Path, list[subprocess.Popen[bytes]]]:
    """`count` daemon agents on loopback, each with its own run directory (kept from a
    previous agent if there is one), in one allocation."""
    alloc = folder / "hosts"
    alloc.unlink(missing_ok=True)
    agents = []
    for i in range(count):
        (folder / f"run{i}").mkdir(mode=0o700, exist_ok=True)
        command = [sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"]
        command += ["--rundir", str(folder / f"run{i}"), "--allocation", str(alloc)]
        agents.append(subprocess.Popen([*command, "--owner-timeout", "2"]))
    wait_until(
        lambda: alloc.exists() and len(alloc.read_text().split()) == count,
        T,
        "the agents to join the allocation",
    )
    return alloc, agents


def _stop(agents: list[subprocess.Popen[bytes]]) -> None:
    for agent in agents:
        agent.terminate()
    for agent in agents:
        agent.wait(T)


@pytest.fixture
def allocation() -> Iterator[Path]:
    """Two daemon agents (two hosts) in separate run directories; the allocation file."""
    folder = Path(RUN_BASE) / f"wsync-{time.monotonic_ns()}"
    folder.mkdir()
    agents: list[subprocess.Popen[bytes]] = []
    try:
        alloc, agents = _start_agents(folder, 2)
        yield alloc
    finally:
        _stop(agents)
        shutil.rmtree(folder, ignore_errors=True)


def _package(root: Path, name: str) -> Path:
    """A small package `name` under `root`: a module, a sub-package and a binary file."""
    (root / name / "sub").mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    (root / name / "calc.py").write_text("VALUE = 1\n")
    (root / name / "extra.py").write_text("EXTRA = True\n")
    (root / name / "sub" / "__init__.py").write_text("DEEP = 'deep'\n")
    (root / name / "weights.bin").write_bytes(os.urandom(3 << 20))  # several pieces
    (root / name / "__pycache__").mkdir()
    (root / name / "__pycache__" / "calc.cpython-310.pyc").write_bytes(b"stale")
    return root


def _written_per_host(sync: WorkspaceSync) -> list[set[str]]:
    return [set(host.written) for host in sync.hosts]


def test_sync_import_change_reload_delete(allocation: Path, tmp_path: Path) -> None:
    pkg = f"wspkg{os.getpid()}"
    code = _package(tmp_path / "code", pkg)
    hosts = attach(str(allocation))
    seen: list[int] = []
    first = hosts.sync_workspace(code, progress=lambda p: seen.append(p.bytes_sent)).get(T)
    files = {f"{pkg}/__init__.py", f"{pkg}/calc.py", f"{pkg}/extra.py", f"{pkg}/sub/__init__.py"}
    files.add(f"{pkg}/weights.bin")
    assert first.name == "code" and len(first.hosts) == 2
    assert _written_per_host(first) == [files, files]  # no __pycache__
    assert all(host.bytes_written > 3 << 20 for host in first.hosts)
    assert seen[-1] == sum((code / p).stat().st_size for p in files)  # each file read once
    assert len({host.path for host in first.hosts}) == 2  # each host its own folder

    procs = hosts.spawn_procs(per_host={"gpus": 1}, name="importers")
    actors = procs.spawn("importers", Importer)
    assert actors.value.call(f"{pkg}.calc", "VALUE").get(T).values() == (1, 1)
    assert actors.value.call(f"{pkg}.sub", "DEEP").get(T).values() == ("deep", "deep")
    origins = actors.origin.call(f"{pkg}.calc").get(T).values()
    assert sorted(origins) == sorted(f"{h.path}/{pkg}/calc.py" for h in first.hosts)

    again = hosts.sync_workspace(code).get(T)  # nothing changed: nothing travels
    assert _written_per_host(again) == [set(), set()] and again.bytes_written == 0

    (code / pkg / "calc.py").write_text("VALUE = 2\n")
    changed = hosts.sync_workspace(code, reload="modules", meshes=[actors]).get(T)
    assert _written_per_host(changed) == [{f"{pkg}/calc.py"}] * 2
    assert changed.bytes_written == 2 * len("VALUE = 2\n")
    assert f"{pkg}.calc" in changed.reloaded
    assert actors.value.call(f"{pkg}.calc", "VALUE").get(T).values() == (2, 2)

    (code / pkg / "extra.py").unlink()
    removed = hosts.sync_workspace(code).get(T)
    assert [set(h.deleted) for h in removed.hosts] == [{f"{pkg}/extra.py"}] * 2
    assert _written_per_host(removed) == [set(), set()]
    extra = [f"{h.path}/{pkg}/extra.py" for h in removed.hosts]
    assert not any(v for path in extra for v in actors.exists.call(path).get(T).values())
    procs.stop().get(T)


def test_restart_runs_the_new_code(allocation: Path, tmp_path: Path) -> None:
    pkg = f"wsrestart{os.getpid()}"
    code = _package(tmp_path / "code", pkg)
    hosts = attach(str(allocation))
    hosts.sync_workspace(code).get(T)
    procs = hosts.spawn_procs(per_host={"gpus": 1}, name="restarted")
    actors = procs.spawn("importers", Importer)
    before = set(actors.pid.call().get(T).values())
    assert actors.value.call(f"{pkg}.calc", "VALUE").get(T).values() == (1, 1)

    (code / pkg / "calc.py").write_text("VALUE = 3\n")
    synced = hosts.sync_workspace(code, reload="restart", meshes=[procs]).get(T)
    assert synced.restarted == 2
    assert _written_per_host(synced) == [{f"{pkg}/calc.py"}] * 2
    assert actors.value.call(f"{pkg}.calc", "VALUE").get(T).values() == (3, 3)
    assert not before & set(actors.pid.call().get(T).values())  # new processes
    procs.stop().get(T)


def test_bad_trees_are_refused_before_anything_travels(allocation: Path, tmp_path: Path) -> None:
    hosts = attach(str(allocation))
    outside = tmp_path / "secret.txt"
    outside.write_text("not yours")
    leaky = tmp_path / "leaky"
    leaky.mkdir()
    (leaky / "link.txt").symlink_to(outside)
    with pytest.raises(WorkspaceError, match=r"symlink .* outside the directory"):
        hosts.sync_workspace(leaky).get(T)
    with pytest.raises(WorkspaceError, match="workspace name"):
        hosts.sync_workspace(tmp_path, remote_name="../escape")
    huge = tmp_path / "huge"
    huge.mkdir()
    with open(huge / "big.bin", "wb") as sparse:
        sparse.truncate(MAX_FILE_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(WorkspaceError, match="over the limit"):
        hosts.sync_workspace(huge).get(T)
    with pytest.raises(WorkspaceError, match="is not a directory"):
        hosts.sync_workspace(tmp_path / "missing").get(T)
    with pytest.raises(ValueError, match="reload must be False, 'modules' or 'restart'"):
        hosts.sync_workspace(tmp_path, reload="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs the meshes to act on"):
        hosts.sync_workspace(tmp_path, reload="modules")
    with pytest.raises(TypeError, match="meshes of type ProcMesh"):
        hosts.sync_workspace(tmp_path, reload="restart", meshes=[hosts])  # type: ignore[list-item]


def test_an_agent_refuses_paths_that_leave_the_workspace(allocation: Path) -> None:
    """A client that skips the checks (a bug, or a hand-made message) cannot write outside."""
    agent = allocation.read_text().split()[0]
    context = new_context()
    inbox = Inbox(context, "tcp://127.0.0.1:*")
    outbox = Outbox(context)

    def answer(request: object) -> object:
        outbox.send(agent, encode(request))
        assert inbox.poll(int(T * 1000)), "the agent did not answer"
        envelope = inbox.receive_nowait()
        assert envelope is not None
        return envelope.header

    try:
        manifest = answer(ws.WorkspaceQuery(1, inbox.address, "evil", "s1"))
        assert isinstance(manifest, ws.WorkspaceManifest) and manifest.why == ""
        digest = hashlib.sha256(b"x").hexdigest()
        for path in ("../escape.py", "/etc/passwd", "a/../../b"):
            chunk = ws.WorkspaceChunk("evil", "s1", path, 0, 1, digest, False, b"x")
            outbox.send(agent, encode(chunk))
        done = answer(ws.WorkspaceCommit(2, inbox.address, "evil", "s1"))
        assert isinstance(done, ws.WorkspaceSynced)
        assert "must be relative" in done.why and done.written == ()
        run_dir = Path(done.path).parent.parent
        assert not (run_dir / "escape.py").exists() and not (run_dir.parent / "escape.py").exists()
        bad_name = answer(ws.WorkspaceQuery(3, inbox.address, "..", "s2"))
        assert "workspace name" in bad_name.why  # type: ignore[attr-defined]
    finally:
        outbox.close(0)
        inbox.close()
        close_context(context)


def test_an_agent_serves_while_it_hashes_a_large_workspace(allocation: Path) -> None:
    """The first manifest of a large workspace takes seconds of hashing; the agent's loop
    answers other messages meanwhile (here a barrier, answered at once)."""
    agent = allocation.read_text().split()[0]
    context = new_context()
    inbox = Inbox(context, "tcp://127.0.0.1:*")
    outbox = Outbox(context)

    def next_answer() -> object:
        assert inbox.poll(int(T * 1000)), "the agent did not answer"
        envelope = inbox.receive_nowait()
        assert envelope is not None
        return envelope.header

    try:
        outbox.send(agent, encode(ws.WorkspaceQuery(1, inbox.address, "large", "s1")))
        assert isinstance(next_answer(), ws.WorkspaceManifest)
        outbox.send(agent, encode(ws.WorkspaceCommit(2, inbox.address, "large", "s1")))
        synced = next_answer()
        assert isinstance(synced, ws.WorkspaceSynced)
        with open(Path(synced.path) / "weights.bin", "wb") as weights:
            weights.truncate(768 << 20)  # sparse: nothing on disk, but every byte is hashed
        outbox.send(agent, encode(ws.WorkspaceQuery(3, inbox.address, "large", "s2")))
        outbox.send(agent, encode(ws.WorkspaceBarrier(4, inbox.address, "large", "s2")))
        first, second = next_answer(), next_answer()
        assert isinstance(first, ws.WorkspaceProgress) and first.request_id == 4
        assert isinstance(second, ws.WorkspaceManifest) and second.request_id == 3
        assert [entry[0] for entry in second.files] == ["weights.bin"]
    finally:
        outbox.close(0)
        inbox.close()
        close_context(context)


@given(st.lists(st.sampled_from(["a", "b", ".", "..", "", "/", "\\", "\0", "c.py"]), max_size=8))
def test_accepted_paths_stay_inside_the_workspace(parts: list[str]) -> None:
    """Whatever a peer sends, a path an agent accepts lands strictly inside the workspace."""
    path = "/".join(parts)
    if workspace_path_problem(path) is None:
        root = "/run/ws"
        landed = os.path.normpath(os.path.join(root, *path.split("/")))
        assert landed.startswith(root + "/") and landed != root
        assert landed == os.path.join(root, path)  # nothing to normalise: no '.', '..', '//'


@given(st.text(max_size=40))
def test_any_text_is_judged_and_only_plain_relative_paths_pass(path: str) -> None:
    problem = workspace_path_problem(path)
    plain = all(part not in ("", ".", "..") for part in path.split("/"))
    assert (problem is None) == (plain and "\0" not in path and "\\" not in path), problem


def test_a_restarted_agent_knows_what_it_has_and_notices_changes(tmp_path: Path) -> None:
    folder = Path(RUN_BASE) / f"wsagain-{time.monotonic_ns()}"
    folder.mkdir()
    agents: list[subprocess.Popen[bytes]] = []
    try:
        alloc, agents = _start_agents(folder, 1)
        code = _package(tmp_path / "code", "again")
        first = attach(str(alloc)).sync_workspace(code).get(T)
        assert len(first.written) == 5
        _stop(agents)
        alloc, agents = _start_agents(folder, 1)  # same run directory, same workspace
        hosts = attach(str(alloc))
        assert hosts.sync_workspace(code).get(T).written == frozenset()
        on_host = Path(first.hosts[0].path) / "again" / "calc.py"
        on_host.write_text("VALUE = 'edited on the host'\n")  # not by a sync
        repaired = hosts.sync_workspace(code).get(T)
        assert repaired.written == {"again/calc.py"} and on_host.read_text() == "VALUE = 1\n"
    finally:
        _stop(agents)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_dead_agent_fails_the_sync_clearly(tmp_path: Path) -> None:
    folder = Path(RUN_BASE) / f"wsdead-{time.monotonic_ns()}"
    folder.mkdir()
    agents: list[subprocess.Popen[bytes]] = []
    try:
        alloc, agents = _start_agents(folder, 1)
        hosts = attach(str(alloc))
        hosts.wait_for_agents(T)
        agents[0].send_signal(signal.SIGKILL)
        agents[0].wait(T)
        (tmp_path / "code").mkdir()
        (tmp_path / "code" / "m.py").write_text("X = 1\n")
        with pytest.raises(WorkspaceError, match="did not answer within 3 s"):
            hosts.sync_workspace(tmp_path / "code", timeout_s=3).get(T)
    finally:
        _stop(agents)
        shutil.rmtree(folder, ignore_errors=True)


NETNS_CLIENT = textwrap.dedent("""
    import json, pathlib
    from mesh import attach
    from workspace_actors import Importer

    code, pkg = pathlib.Path({code!r}), {pkg!r}
    hosts = attach([{agent!r}], listen_host={listen!r})
    first = hosts.sync_workspace(code, progress=False).get(60)
    actors = hosts.spawn_procs(per_host={{"gpus": 1}}).spawn("importers", Importer)
    before = actors.value.call_one(pkg + ".calc", "VALUE").get(60)
    (code / pkg / "calc.py").write_text("VALUE = 2\\n")
    second = hosts.sync_workspace(code, reload="modules", meshes=[actors]).get(60)
    after = actors.value.call_one(pkg + ".calc", "VALUE").get(60)
    print(json.dumps([sorted(first.written), before, sorted(second.written), after]))
""")


def test_sync_to_an_agent_in_a_network_namespace(
    namespace: tuple[str, str, str, str], tmp_path: Path
) -> None:
    """Across a real link (a veth pair into a namespace), with CURVE keys as beyond loopback."""
    name, _, host_address, ns_address = namespace
    keys = tmp_path / "keys"
    meshvisor = [sys.executable, "-m", "meshvisor"]
    subprocess.run([*meshvisor, "keys", str(keys)], check=True, capture_output=True)
    address_file, rundir = tmp_path / "address", tmp_path / "run"
    rundir.mkdir(mode=0o700)
    command = [
        "ip",
        "netns",
        "exec",
        name,
        *meshvisor,
        "agent",
        "--listen",
        f"tcp://{ns_address}:0",
    ]
    command += ["--address-file", str(address_file), "--rundir", str(rundir), "--keys", str(keys)]
    agent = subprocess.Popen([*command, "--owner-timeout", "2"])
    try:
        wait_until(address_file.exists, T, "the agent in the namespace to start")
        pkg = f"wsnetns{os.getpid()}"
        code = _package(tmp_path / "code", pkg)
        script = NETNS_CLIENT.format(
            code=str(code), pkg=pkg, agent=address_file.read_text().strip(), listen=host_address
        )
        tests = str(Path(__file__).parent)
        path = os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "MESHVISOR_CURVE_KEYS": str(keys), "PYTHONPATH": path}
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=T * 2
        )
        assert done.returncode == 0, done.stderr[-3000:]
        first, before, second, after = json.loads(done.stdout.strip().splitlines()[-1])
        assert len(first) == 5 and before == 1
        assert second == [f"{pkg}/calc.py"] and after == 2
    finally:
        agent.terminate()
        try:
            agent.wait(T)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(T)


def test_the_sync_verb_prints_progress_and_what_each_host_wrote(
    allocation: Path, tmp_path: Path
) -> None:
    code = tmp_path / "tool"
    code.mkdir()
    (code / "big.bin").write_bytes(os.urandom(5 << 20))  # large enough for a progress line
    (code / "run.py").write_text("print('hi')\n")
    command = [sys.executable, "-m", "meshvisor", "sync", str(allocation), str(code)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=T * 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "syncing workspace: 5.0 of 5.0 MiB, 2 of 2 files" in done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 and all("2 files written, 0 removed" in line for line in lines)
    again = subprocess.run(command, capture_output=True, text=True, timeout=T * 2)
    assert again.stdout.count("0 files written, 0 removed, 0 bytes") == 2
    missing = subprocess.run(
        [*command[:-1], str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert missing.returncode == 1 and "is not a directory" in missing.stderr
