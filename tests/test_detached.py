"""Detached meshes: procs and actors that outlive their client, adopted by the next one.

Two real ``meshvisor agent`` daemons over tcp on loopback play two hosts; clients are real
subprocesses, SIGKILLed mid-run. The adopter here is this test process.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from actors import Counter
from hypothesis import given, settings
from hypothesis import strategies as st
from polling import pid_alive, wait_gone, wait_until

from mesh import AdoptionError, attach
from mesh.testing import detached_wire
from supervision import SupervisionError, SupervisionEvent
from transport import encode

T = 30.0
OWNER_TIMEOUT_S = 1.0

COUNTER = """
import os, sys, time
from mesh import Actor, attach, current_rank, endpoint

class Counter(Actor):
    def __init__(self, start):
        self.count = start

    @endpoint
    def add(self, n):
        self.count += n
        return os.getpid(), self.count

    @endpoint
    def fail(self):
        raise SystemExit("failing on purpose")

    @endpoint
    async def fail_in(self, seconds):
        import asyncio

        await asyncio.sleep(seconds)
        raise SystemExit("failing on purpose, later")
"""

#: Spawns a detached mesh "job" (2 hosts x 2) and a plain one, prints their pids, waits.
SIGKILLED_CLIENT = (
    COUNTER
    + """
hosts = attach({alloc!r})
job = hosts.spawn_procs(per_host={{"gpus": 2}}, name="job", detached=True)
counters = job.spawn("counters", Counter, 10)
pids = [pid for pid, _ in counters.add.call(5).get(timeout=30).values()]
plain = hosts.spawn_procs(per_host={{"gpus": 1}}, name="plain")
plain_pids = [p for p, _ in plain.spawn("c", Counter, 0).add.call(1).get(timeout=30).values()]
# FAIL_LATER
print("PIDS", *pids, flush=True)
print("PLAIN", *plain_pids, flush=True)
time.sleep(120)
"""
)


@pytest.fixture(autouse=True)
def client_home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR for the client scripts, whose run directories a SIGKILL
    leaves behind: removed afterwards, pass or fail (this process's session is made first,
    in the suite's base)."""
    from conftest import RUN_BASE

    import mesh.testing

    mesh.testing.run_dir()
    home = Path(tempfile.mkdtemp(prefix="h", dir=RUN_BASE))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(home))
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def allocation(tmp_path: Path) -> Iterator[tuple[Path, list[int]]]:
    """Two daemon agents in one allocation file; yields the file and the agents' pids."""
    from conftest import RUN_BASE

    folder = Path(RUN_BASE) / f"detached-{time.monotonic_ns()}"
    folder.mkdir()
    alloc = folder / "hosts"
    agents = []
    try:
        for i in range(2):
            (folder / f"run{i}").mkdir(mode=0o700)
            command = [sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"]
            command += ["--rundir", str(folder / f"run{i}"), "--allocation", str(alloc)]
            command += ["--owner-timeout", str(OWNER_TIMEOUT_S)]
            agents.append(subprocess.Popen(command))
        wait_until(
            lambda: alloc.exists() and len(alloc.read_text().split()) == 2,
            T,
            "both agents to join the allocation",
        )
        yield alloc, [agent.pid for agent in agents]
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.wait(T)
        shutil.rmtree(folder, ignore_errors=True)


def _script(tmp_path: Path, name: str, text: str, alloc: Path) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).format(alloc=str(alloc)))
    return path


def _start(script: Path, stdin: int | None = None) -> subprocess.Popen[str]:
    """Run a client script; its stderr goes to a file beside it (a pipe nobody reads while
    the test waits on stdout could fill and block the client)."""
    with open(_stderr_of(script), "a") as stderr:
        return subprocess.Popen(
            [sys.executable, str(script)],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )


def _stderr_of(script: Path) -> Path:
    return script.with_suffix(".stderr")


def _line(client: subprocess.Popen[str], prefix: str) -> list[str]:
    line = client.stdout.readline()  # type: ignore[union-attr]
    script = Path(str(client.args[1]))  # type: ignore[index]
    assert line.startswith(prefix), (line, _stderr_of(script).read_text())
    return line.split()[1:]


def _end(client: subprocess.Popen[str]) -> None:
    client.kill()
    client.communicate(timeout=T)


def _kill_client(tmp_path: Path, alloc: Path, extra: str = "") -> tuple[list[int], list[int]]:
    """Run the client that detaches "job" (and runs `extra`), SIGKILL it mid-run; the pids
    of job and plain."""
    text = SIGKILLED_CLIENT.replace("# FAIL_LATER", extra)
    client = _start(_script(tmp_path, "client.py", text, alloc))
    try:
        pids = [int(pid) for pid in _line(client, "PIDS")]
        plain = [int(pid) for pid in _line(client, "PLAIN")]
    finally:
        _end(client)
    return pids, plain


def _recorder() -> tuple[list[SupervisionEvent], Any]:
    events: list[SupervisionEvent] = []
    return events, lambda event: events.append(event) or True


def test_a_new_client_adopts_the_same_procs_and_actors_with_their_state(
    allocation: tuple[Path, list[int]], tmp_path: Path
) -> None:
    alloc, _ = allocation
    pids, plain = _kill_client(tmp_path, alloc)
    wait_gone(plain, T)  # a mesh that is not detached is reaped as before
    assert all(pid_alive(pid) for pid in pids), "the detached procs outlive their client"
    events, record = _recorder()
    job = attach(str(alloc)).adopt_procs("job", on_failure=record)
    try:
        counters = job.actor_mesh("counters")
        assert job.sizes == {"hosts": 2, "gpus": 2} and counters.sizes == job.sizes
        answers = counters.add.call(1).get(timeout=T).values()
        assert [pid for pid, _ in answers] == pids  # the same processes, none restarted
        assert [count for _, count in answers] == [16] * 4  # 10 + 5 before, + 1 now
        assert events == []
    finally:
        job.stop().get(timeout=T)
    wait_gone(pids, T)


def test_a_failure_in_the_gap_reaches_the_adopter_and_so_does_a_later_one(
    allocation: tuple[Path, list[int]], tmp_path: Path
) -> None:
    alloc, _ = allocation
    pids, _ = _kill_client(tmp_path, alloc)
    os.kill(pids[3], signal.SIGKILL)  # while nobody owns the mesh: kept by its agent
    wait_gone([pids[3]], T)
    hosts = attach(str(alloc))
    wait_until(lambda: hosts.detached_meshes()[0].kept_failures == 1, T, "the kept failure")
    events, record = _recorder()
    job = hosts.adopt_procs("job", on_failure=record)
    try:
        wait_until(lambda: len(events) == 1, T, "the kept failure to reach the adopter")
        assert events[0].kind == "signal" and events[0].signal == "SIGKILL"
        assert dict(events[0].rank) == {"hosts": 1, "gpus": 1} and events[0].pid == pids[3]
        counters = job.actor_mesh("counters")
        counters.slice(hosts=0, gpus=1).fail.broadcast()  # an actor fails after adoption
        wait_until(lambda: len(events) == 2, T, "the new failure to reach the new owner")
        assert events[1].kind == "exception" and "failing on purpose" in events[1].message
        assert dict(events[1].rank) == {"hosts": 0, "gpus": 1}
        os.kill(pids[0], signal.SIGKILL)  # and a proc
        wait_until(lambda: len(events) == 3, T, "the proc's failure to reach the new owner")
        assert events[2].kind == "signal" and events[2].pid == pids[0]
    finally:
        job.stop().get(timeout=T)
    wait_gone(pids, T)
    wait_until(lambda: hosts.detached_meshes() == [], T, "the stopped mesh to be forgotten")


RACER = (
    COUNTER
    + """
from mesh import AdoptionError
try:
    attach({alloc!r}).adopt_procs("race")
except AdoptionError as error:
    print("REFUSED", error, flush=True)
else:
    print("ADOPTED", flush=True)
sys.stdin.read()
"""
)

DETACH_AND_EXIT = (
    COUNTER
    + """
procs = attach({alloc!r}).spawn_procs(per_host={{"gpus": 1}}, name="race", detached=True)
print("PIDS", *[p for p, _ in procs.spawn("c", Counter, 0).add.call(1).get(30).values()])
"""
)


def test_two_clients_racing_to_adopt_one_wins_the_other_is_told_who(
    allocation: tuple[Path, list[int]], tmp_path: Path
) -> None:
    alloc, _ = allocation
    script = _script(tmp_path, "detach.py", DETACH_AND_EXIT, alloc)
    first = _start(script)
    out, _ = first.communicate(timeout=T)
    assert first.returncode == 0, _stderr_of(script).read_text()  # a clean exit keeps it too
    pids = [int(pid) for pid in out.split()[1:]]
    assert all(pid_alive(pid) for pid in pids)
    racer = _script(tmp_path, "racer.py", RACER, alloc)
    racers = [_start(racer, stdin=subprocess.PIPE) for _ in range(2)]
    try:
        lines = sorted(r.stdout.readline() for r in racers)  # type: ignore[union-attr]
        assert lines[0].startswith("ADOPTED"), lines
        assert lines[1].startswith("REFUSED") and "owned by the client at" in lines[1], lines
    finally:
        for each in racers:
            _end(each)
    cli = [sys.executable, "-m", "meshvisor", "meshes"]
    listed = subprocess.run([*cli, "list", str(alloc)], capture_output=True, text=True, timeout=T)
    assert listed.returncode == 0, listed.stderr
    assert "race" in listed.stdout and "2/2" in listed.stdout, listed.stdout
    stopped = subprocess.run(
        [*cli, "stop", str(alloc), "race"], capture_output=True, text=True, timeout=T
    )
    assert stopped.returncode == 0 and "2 procs" in stopped.stdout, stopped.stderr
    wait_gone(pids, T)
    wait_until(lambda: attach(str(alloc)).detached_meshes() == [], T, "the mesh to be forgotten")


IDEMPOTENT = (
    COUNTER
    + """
hosts = attach({alloc!r})
procs = hosts.get_or_spawn_procs("idem", per_host={{"gpus": 1}})
counters = procs.get_or_spawn("counters", Counter, 100)
print("COUNT", *[count for _, count in counters.add.call(1).get(30).values()], flush=True)
"""
)


def test_get_or_spawn_makes_scripts_idempotent(
    allocation: tuple[Path, list[int]], tmp_path: Path
) -> None:
    alloc, _ = allocation
    script = _script(tmp_path, "idem.py", IDEMPOTENT, alloc)
    for expected in ("101", "102"):
        run = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=T * 2
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == ["COUNT", expected, expected], run.stdout
    hosts = attach(str(alloc))
    procs = hosts.get_or_spawn_procs("idem", per_host={"gpus": 1})
    try:
        assert hosts.get_or_spawn_procs("idem", per_host={"gpus": 1}) is not None
        with pytest.raises(ValueError, match="has sizes"):
            hosts.get_or_spawn_procs("idem", per_host={"gpus": 3})
        with pytest.raises(ValueError, match="bytes its host agents keep"):
            procs.spawn("big", Counter, b"x" * 2_000_000)
        with pytest.raises(AdoptionError, match="owned by"):
            _adopt_from_another_client(tmp_path, alloc)
    finally:
        procs.stop().get(timeout=T)
    wait_until(lambda: hosts.detached_meshes() == [], T, "the mesh to be forgotten")


def _adopt_from_another_client(tmp_path: Path, alloc: Path) -> None:
    script = _script(tmp_path, "other.py", RACER.replace('"race"', '"idem"'), alloc)
    other = subprocess.Popen(
        [sys.executable, str(script)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = other.communicate(timeout=T)
    if out.startswith("REFUSED"):
        raise AdoptionError(out)
    raise AssertionError(f"a second client adopted a mesh this one owns: {out} {err}")


TTL_CLIENT = (
    COUNTER
    + """
procs = attach({alloc!r}).spawn_procs(per_host={{"gpus": 1}}, name="brief", detached=True, ttl_s=1)
print("PIDS", *[p for p, _ in procs.spawn("c", Counter, 0).add.call(1).get(30).values()])
"""
)


def test_a_mesh_without_an_owner_for_its_ttl_is_stopped(
    allocation: tuple[Path, list[int]], tmp_path: Path
) -> None:
    alloc, _ = allocation
    script = _script(tmp_path, "ttl.py", TTL_CLIENT, alloc)
    client = _start(script)
    out, _ = client.communicate(timeout=T)
    assert client.returncode == 0, _stderr_of(script).read_text()
    pids = [int(pid) for pid in out.split()[1:]]
    wait_gone(pids, T)
    wait_until(lambda: attach(str(alloc)).detached_meshes() == [], T, "the mesh to be forgotten")


def test_agents_that_end_with_their_client_refuse_to_detach() -> None:
    from mesh import this_host

    with pytest.raises(ValueError, match="persistent allocation"):
        this_host().spawn_procs(per_host={"gpus": 1}, name="nope", detached=True)
    with pytest.raises(ValueError, match="ttl_s"):
        this_host().spawn_procs(name="nope", detached=True, ttl_s=-1)


def test_an_actor_failure_in_the_gap_reaches_the_adopters_root_like_any_failure(
    allocation: tuple[Path, list[int]], tmp_path: Path, root_events: list[SupervisionEvent]
) -> None:
    """Without a handler, a failure kept in the gap goes where any unhandled failure goes
    (fail-fast, here the test's recording hook)."""
    alloc, _ = allocation
    # The call to another actor of that proc, after the broadcast (one sender, one proc: in
    # order), confirms the broadcast left the client before the client is SIGKILLed.
    later = (
        "probe = job.spawn('probe', Counter, 0).slice(hosts=0, gpus=1)\n"
        "counters.slice(hosts=0, gpus=1).fail_in.broadcast(2.0)\n"
        "probe.add.call_one(0).get(timeout=30)"
    )
    pids, _ = _kill_client(tmp_path, alloc, later)  # killed before the actor fails
    hosts = attach(str(alloc))
    wait_until(lambda: hosts.detached_meshes()[0].kept_failures == 1, T, "the kept failure")
    job = hosts.adopt_procs("job")
    try:
        wait_until(lambda: len(root_events) == 1, T, "the kept failure to reach the root")
        event = root_events[0]
        assert event.kind == "exception" and "failing on purpose, later" in event.message
        assert event.mesh_name == "counters" and dict(event.rank) == {"hosts": 0, "gpus": 1}
        alive = job.actor_mesh("counters").slice(hosts=1).add.call(0).get(timeout=T).values()
        assert [pid for pid, _ in alive] == pids[2:]
    finally:
        job.stop().get(timeout=T)
    wait_gone(pids, T)


# -- an agent takes any message of detached meshes without harm ------------------------------------


def _declared(hint: Any) -> st.SearchStrategy[Any]:
    """Values of the declared type `hint` of a message field (any value, not just sane ones)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        return st.lists(_declared(args[0]), max_size=3).map(tuple)
    if origin is typing.Union or origin is types.UnionType:
        return st.one_of(*map(_declared, args))
    simple: dict[Any, st.SearchStrategy[Any]] = {
        type(None): st.none(),
        str: st.one_of(st.text(max_size=12), st.sampled_from(["ipc:///nowhere/x", "m"])),
        int: st.one_of(st.integers(-3, 3), st.integers()),
        float: st.floats(),
        bool: st.booleans(),
        bytes: st.binary(max_size=16),
    }
    if hint in simple:
        return simple[hint]
    return _messages(hint)


def _messages(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    return st.tuples(*(_declared(hints[n]) for n in names)).map(lambda vs: cls(*vs))


DETACHED_TYPES = sorted(
    (
        cls
        for cls in vars(detached_wire).values()
        if isinstance(cls, type)
        and dataclasses.is_dataclass(cls)
        and cls.__module__ == detached_wire.__name__
    ),
    key=lambda cls: cls.__name__,
)


@pytest.mark.timeout(180)
def test_any_message_of_detached_meshes_leaves_the_agent_serving(tmp_path: Path) -> None:
    """For all messages of detached meshes, whatever their values: the agent neither crashes
    nor loses the meshes it keeps, and still answers."""
    from conftest import RUN_BASE

    folder = Path(RUN_BASE) / f"fuzz-{time.monotonic_ns()}"
    folder.mkdir(mode=0o700)
    address = f"ipc://{folder}/agent"
    command = [sys.executable, "-m", "meshvisor", "agent", "--listen", address]
    agent = subprocess.Popen([*command, "--rundir", str(folder)])
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        hosts = attach([address])
        hosts.wait_for_agents(T)
        procs = hosts.spawn_procs(per_host={"gpus": 1}, name="keepme", detached=True)
        counters = procs.spawn("counters", Counter, 1)
        assert counters.incr.call_one(1).get(timeout=T) == 2
        push.connect(address)

        @settings(max_examples=300, deadline=None, database=None)
        @given(st.sampled_from(DETACHED_TYPES).flatmap(_messages))
        def send(message: Any) -> None:
            if getattr(message, "name", None) != "keepme":  # those may stop it on purpose
                push.send_multipart(encode(message))

        send()
        (info,) = [m for m in hosts.detached_meshes() if m.name == "keepme"]
        assert info.alive == 1 and info.owner
        assert counters.incr.call_one(1).get(timeout=T) == 3
        assert agent.poll() is None
        procs.stop().get(timeout=T)
    finally:
        push.close()
        context.term()
        agent.terminate()
        agent.wait(T)
        shutil.rmtree(folder, ignore_errors=True)


def test_the_adopter_applies_the_restart_policy_the_mesh_was_spawned_with(
    allocation: tuple[Path, list[int]], tmp_path: Path
) -> None:
    alloc, _ = allocation
    policy = "from supervision import RestartPolicy\nRESTART = RestartPolicy(max_restarts=3)\n"
    script = SIGKILLED_CLIENT.replace("detached=True)", "detached=True, restart=RESTART)")
    client = _start(_script(tmp_path, "restart.py", policy + script, alloc))
    try:
        pids = [int(pid) for pid in _line(client, "PIDS")]
    finally:
        _end(client)
    os.kill(pids[1], signal.SIGKILL)  # in the gap: nobody re-spawns it yet
    wait_gone([pids[1]], T)
    hosts = attach(str(alloc))
    wait_until(lambda: hosts.detached_meshes()[0].kept_failures == 1, T, "the kept failure")
    events, record = _recorder()
    job = hosts.adopt_procs("job", on_failure=record)
    try:
        counters = job.actor_mesh("counters")

        def rebuilt() -> bool:
            try:
                return counters.slice(hosts=0, gpus=1).add.call_one(0).get(timeout=T)[1] == 10
            except SupervisionError:
                return False  # a call that reached the dead proc before the re-spawn

        wait_until(rebuilt, T, "the policy to re-spawn rank 1 with its actor")
        answers = counters.add.call(0).get(timeout=T).values()
        now = [pid for pid, _ in answers]
        assert now[1] != pids[1] and now[:1] + now[2:] == pids[:1] + pids[2:]  # others kept
        assert [count for _, count in answers] == [15, 10, 15, 15]
        assert events == []  # handled by the policy
        (info,) = hosts.detached_meshes()
        assert info.alive == 4 and info.procs == 4
    finally:
        job.stop().get(timeout=T)
    wait_until(lambda: hosts.detached_meshes() == [], T, "the stopped mesh to be forgotten")
