"""Host agents under hostile or careless input: dead agents, undrained output, wrongly typed
messages, large requests, long names, full disks and stale bookkeeping.

Every test uses real agents, procs and sockets. Failures that reach the client are recorded by
the `root_events` fixture (so they never interrupt pytest) and looked at where they matter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import actors
import pytest
import zmq
from conftest import RUN_BASE, meshvisor_processes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polling import wait_until
from test_fault_hooks import DaemonAgent, make_daemon  # noqa: F401 (a fixture)

import mesh.testing
from mesh import ActorMesh, attach, this_host, this_proc
from mesh.testing import wire
from supervision import SupervisionError
from transport import MAGIC, Envelope, Inbox, close_context, encode, new_context

T = 30.0  # the bound on every wait (never reached when things work)
AGENT = (sys.executable, "-m", "meshvisor", "agent")  # a daemon host agent, as users start one


# -- 8: spawning on an agent that is gone ends ----------------------------------------------------


@pytest.mark.timeout(60)
def test_spawn_procs_on_a_killed_local_agent_fails(root_events: list[Any]) -> None:
    host = this_host()
    agent = mesh.testing.local_agent().process
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
    # The caller's get() may raise before the owner's hook has run (both follow one event).
    wait_until(lambda: len(root_events) >= 2, T, "the hook to hear of both failures")
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


# -- 12: wrongly typed messages are rejected, never fatal ------------------------------------------


class RawPeer:
    """A raw PUSH socket to one inbox (any bytes, any header), and an inbox of our own that
    hears the answers to barrier requests: FIFO per sender, so once a barrier is answered the
    target has handled everything sent before it."""

    def __init__(self, address: str, home: Path) -> None:
        self._zmq = new_context()
        self._push = self._zmq.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(address)
        self.inbox = Inbox(self._zmq, f"ipc://{home}/raw-{len(os.listdir(home))}")

    def send(self, frames: list[Any]) -> None:
        self._push.send_multipart(frames)

    def answer(self, barrier: Any) -> Envelope:
        """Send `barrier` and return the first message that comes back."""
        self.send(encode(barrier))
        assert self.inbox.poll(int(T * 1000)), f"no answer to {barrier}"
        envelope = self.inbox.receive_nowait()
        assert envelope is not None
        return envelope

    def close(self) -> None:
        self._push.close(linger=0)
        self.inbox.close()
        close_context(self._zmq)


@contextlib.contextmanager
def raw_peer(address: str) -> Iterator[RawPeer]:
    with client_home() as home:
        peer = RawPeer(address, home)
        try:
            yield peer
        finally:
            peer.close()


def agent_barrier(peer: RawPeer) -> None:
    """The agent answers a stop of a proc it never ran with an exit report."""
    answer = peer.answer(wire.StopProcs(("never-ran-0",), 0.0, peer.inbox.address))
    assert type(answer.header) is wire.ProcExited, answer


def local_agent() -> tuple[str, int]:
    """The address and pid of the client's local host agent (started if need be)."""
    agent = mesh.testing.local_agent()
    return agent.address, agent.pid


WRONGLY_TYPED = [
    wire.SpawnProcs("ipc://x", [1], (), (), "/", 0.25, 2.0),  # type: ignore[arg-type]
    wire.SpawnProcs(
        "ipc://x", (wire.ProcSpec("../escape", "m", (), (), 0),), (), (), "/", 0.25, 2.0
    ),
    wire.StopProcs(7, 1.0),  # type: ignore[arg-type]
    wire.StopProcs(("a",), float("nan")),
    wire.Heartbeat(["a"]),  # type: ignore[arg-type]
    wire.OwnerAlive({"a": 1}),  # type: ignore[arg-type]
    wire.ProcReady(1, 2, "3", 4),  # type: ignore[arg-type]
    wire.WatchProcs(None, 5),  # type: ignore[arg-type]
    wire.ShutdownAgent("soon"),  # type: ignore[arg-type]
    wire.SetFaultRules(5),  # type: ignore[arg-type]
]


@pytest.mark.timeout(60)
def test_wrongly_typed_messages_do_not_kill_the_agent(make_procs: Any) -> None:
    procs = make_procs({"gpus": 1})
    echo = procs.spawn("echo", actors.Echo)
    assert echo.echo.call_one(1).get(timeout=T) == 1
    agent = mesh.testing.local_agent()
    address, pid = agent.address, agent.pid
    with raw_peer(address) as peer:
        for header in WRONGLY_TYPED:
            peer.send(encode(header))
        agent_barrier(peer)
    assert agent.process.poll() is None
    assert echo.echo.call_one(2).get(timeout=T) == 2
    with this_host().spawn_procs(per_host={"gpus": 1}) as more:
        assert more.spawn("echo", actors.Echo).echo.call_one(3).get(timeout=T) == 3
    assert local_agent() == (address, pid)


# -- the fuzz test: random frames and randomly typed headers of every message type -----------------

MESSAGE_TYPES = sorted(
    (
        cls
        for cls in vars(wire).values()
        if isinstance(cls, type)
        and dataclasses.is_dataclass(cls)
        and cls.__module__ == wire.__name__
    ),
    key=lambda cls: cls.__name__,
)
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.lists(st.integers(), max_size=3),
    st.tuples(st.text(max_size=4)),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.frozensets(st.text(max_size=4), max_size=2),
)


def typed(hint: Any) -> st.SearchStrategy[Any]:
    """Values of the declared type `hint` (any content)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is __import__("types").UnionType:
        return st.one_of(*map(typed, args))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(typed(args[0]), max_size=3).map(tuple)
    if origin is tuple:
        return st.tuples(*map(typed, args))
    if origin is frozenset:
        return st.frozensets(typed(args[0]), max_size=3)
    simple = {
        type(None): st.none(),
        str: st.text(max_size=20),
        int: st.integers(),
        float: st.floats(),
        bool: st.booleans(),
        bytes: st.binary(max_size=20),
    }
    return simple[hint] if hint in simple else instances(hint)


def instances(cls: type) -> st.SearchStrategy[Any]:
    """Instances of dataclass `cls` whose fields are of the declared type or of any other."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = st.tuples(*(st.one_of(typed(hints[n]), ANY_VALUE) for n in names))
    return values.map(lambda vs: _unchecked(cls, dict(zip(names, vs, strict=True))))


def _unchecked(cls: type, fields: dict[str, Any]) -> Any:
    """An instance built without running its constructor's checks, as a decoder would."""
    instance = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(instance, name, value)
    return instance


RAW_FRAMES = st.one_of(
    st.lists(st.binary(max_size=64), min_size=1, max_size=3),
    st.binary(max_size=64).map(lambda body: [MAGIC + body]),  # past the magic bytes
)


def disruptive(header: Any, target: str) -> bool:
    """Valid commands that legitimately end or reconfigure `target` (not what this tests)."""
    if type(header) is wire.SetFaultRules:
        return wire.invalid_fields(header) is None
    if target == "agent":
        return type(header) is wire.ShutdownAgent and wire.invalid_request(header) is None
    return target == "proc" and type(header) is wire.StopProc


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def fuzz(peer: RawPeer, target: str) -> None:
    """Send random frames and random headers of every message type to `peer`'s target."""
    headers = st.sampled_from(MESSAGE_TYPES).flatmap(instances)

    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.one_of(headers, RAW_FRAMES))
    def send_one(message: Any) -> None:
        if isinstance(message, list):
            peer.send(message)
        elif not disruptive(message, target):
            peer.send(encode(message))

    send_one()


def ping(actor_id: str, reply_to: str) -> wire.CallActor:
    """A call of the builtin ``__ping__`` endpoint of actor `actor_id` (``mesh[rank]``: calls
    address the actor mesh, which is the id without the rank)."""
    mesh_id = actor_id.rsplit("[", 1)[0]
    return wire.CallActor(1, reply_to, mesh_id, "__ping__", (), (), 0)


MAX_GROWTH = 64 << 20  # bytes of RSS a fuzzed process may gain (a leak per frame would not fit)


@pytest.mark.timeout(120)
def test_fuzzed_agent_keeps_serving(make_procs: Any) -> None:
    address, pid = local_agent()
    with raw_peer(address) as peer:
        agent_barrier(peer)
        before = rss_bytes(pid)
        fuzz(peer, "agent")
        agent_barrier(peer)
        assert rss_bytes(pid) - before < MAX_GROWTH
    procs = make_procs({"gpus": 1})
    assert procs.spawn("echo", actors.Echo).echo.call_one(1).get(timeout=T) == 1
    assert local_agent() == (address, pid)


@pytest.mark.timeout(120)
def test_fuzzed_proc_keeps_serving(make_procs: Any) -> None:
    exposed = make_procs({"gpus": 1}).spawn("who", actors.Exposed)
    pid, address, mesh_id = exposed.reach.call_one().get(timeout=T)
    with raw_peer(address) as peer:
        assert peer.answer(ping(mesh_id, peer.inbox.address)).header.rank == 0
        before = rss_bytes(pid)
        fuzz(peer, "proc")
        assert type(peer.answer(ping(mesh_id, peer.inbox.address)).header) is wire.Reply
        assert rss_bytes(pid) - before < MAX_GROWTH
    assert exposed.reach.call_one().get(timeout=T)[0] == pid


@pytest.mark.timeout(120)
def test_fuzzed_client_keeps_serving(make_procs: Any, root_events: list[Any]) -> None:
    local: ActorMesh[actors.WhoAmI] = this_proc().spawn("who", actors.WhoAmI)
    actor_id = local.whoami.call_one().get(timeout=T)["actor_id"]
    # Its ipc address: after a test that attached to tcp agents, its tcp one needs keys.
    with raw_peer(mesh.testing.inbox_address(local=True)) as peer:
        peer.answer(ping(actor_id, peer.inbox.address))
        before = rss_bytes(os.getpid())
        fuzz(peer, "client")
        assert type(peer.answer(ping(actor_id, peer.inbox.address)).header) is wire.Reply
        assert rss_bytes(os.getpid()) - before < MAX_GROWTH
    echo = make_procs({"gpus": 1}).spawn("echo", actors.Echo)
    assert echo.echo.call_one(5).get(timeout=T) == 5
    assert not root_events, root_events


# -- 13: large requests work or are refused clearly ------------------------------------------------


@pytest.mark.timeout(90)
def test_a_large_env_reaches_every_proc(make_procs: Any) -> None:
    agent = local_agent()
    big = "x" * 1_000_000  # several times what one fork-server packet can hold
    procs = make_procs({"gpus": 2}, env={"BIG": big})
    values = procs.spawn("echo", actors.Echo).getenv.call("BIG").get(timeout=T).values()
    assert [len(value) for value in values] == [len(big)] * 2
    assert local_agent() == agent


@pytest.mark.timeout(120)
def test_a_burst_of_spawn_requests_waits_for_the_fork_server(make_procs: Any) -> None:
    agent = local_agent()
    # one batch request: the procs share the value, which makes it more than the socket holds
    procs = make_procs({"gpus": 12}, env={"PAD": "p" * 400_000})
    pids = procs.spawn("echo", actors.Echo).pid.call().get(timeout=60).values()
    assert len(set(pids)) == 12
    assert local_agent() == agent


@pytest.mark.timeout(60)
def test_long_and_odd_mesh_names(make_procs: Any) -> None:
    agent = local_agent()
    host = this_host()
    with pytest.raises(ValueError, match="300 characters long; use at most 255"):
        host.spawn_procs(per_host={"gpus": 1}, name="n" * 300)
    with pytest.raises(ValueError, match="'/'"):
        host.spawn_procs(per_host={"gpus": 1}, name="../../outside")
    with pytest.raises(ValueError, match="non-empty name"):
        host.spawn_procs(per_host={"gpus": 1}, name="")
    odd = "Ünïcode .. names-with spaces " * 8  # long, but under the limit
    procs = make_procs({"gpus": 1}, name=odd)
    with pytest.raises(ValueError, match="'/'"):
        procs.spawn("a/b", actors.Echo)
    who = procs.spawn(odd, actors.WhoAmI).whoami.call_one().get(timeout=T)
    assert who["mesh_name"] == odd
    assert os.path.exists(
        os.path.join(mesh.testing.run_dir(), who["proc_id"])
    )  # its socket, in the run dir
    assert local_agent() == agent


@pytest.mark.timeout(60)
def test_a_refused_spawn_request_fails_its_procs(root_events: list[Any]) -> None:
    """The agent refuses a request it cannot act on, and says so to the owner, whose procs
    fail at once (this client checks its own requests, so a raw one plays a bad client)."""
    address, _ = local_agent()
    spec = wire.ProcSpec("refused-0", "refused", ("gpus",), (1,), 0)
    with raw_peer(address) as peer:
        bad = wire.SpawnProcs(peer.inbox.address, (spec,), (("A=B", "x"),), (), "/", 0.25, 2.0)
        answer = peer.answer(bad)
        assert type(answer.header) is wire.SpawnFailed
        assert answer.header.proc_id == "refused-0" and "'='" in answer.header.reason
    assert not root_events


@pytest.mark.timeout(60)
def test_a_spawn_with_a_busy_timeout_that_is_no_duration_is_refused() -> None:
    """A busy timeout of nan would turn the agent's busy limit off: it is refused."""
    address, _ = local_agent()
    spec = wire.ProcSpec("nan-busy-0", "nan-busy", ("gpus",), (1,), 0)
    with raw_peer(address) as peer:
        bad = wire.SpawnProcs(
            peer.inbox.address, (spec,), (), (), "/", 0.25, 2.0, busy_timeout_s=float("nan")
        )
        answer = peer.answer(bad)
        assert type(answer.header) is wire.SpawnFailed
        assert answer.header.proc_id == "nan-busy-0" and "busy_timeout_s" in answer.header.reason


# -- 18: run directories, socket paths and bookkeeping ---------------------------------------------


def start_daemon(home: Path, rundir: Path, *extra: str) -> tuple[str, subprocess.Popen[bytes]]:
    """A daemon agent listening at a short ipc path in `home`, its procs' sockets in `rundir`."""
    address = f"ipc://{home}/a{len(os.listdir(home))}"
    address_file = home / f"address-{len(os.listdir(home))}"
    command = [*AGENT, "--listen", address, "--rundir", str(rundir)]
    agent = subprocess.Popen([*command, "--address-file", str(address_file), *extra])
    wait_until(address_file.exists, T, "the agent to listen")
    return address, agent


def spawn_failure(address: str) -> str:
    """The error of a call to a proc spawned on the agent at `address`."""
    procs = attach([address]).spawn_procs(per_host={"gpus": 1}, name="nowhere")
    try:
        with pytest.raises(SupervisionError) as info:
            procs.spawn("echo", actors.Echo).echo.call_one(1).get(timeout=T)
        return str(info.value)
    finally:
        procs.stop().get(timeout=T)


@pytest.mark.timeout(60)
def test_a_proc_that_cannot_listen_says_why(root_events: list[Any]) -> None:
    with client_home() as home:
        long_rundir = home / ("r" * 90)
        long_rundir.mkdir(mode=0o700)
        address, agent = start_daemon(home, long_rundir)
        try:
            error = spawn_failure(address)
            assert "bytes long, over the" in error and "--rundir" in error, error
            os.rmdir(long_rundir)  # now the socket path is short but cannot be bound
            short = home / "gone"
            address, second = start_daemon(home, short)
            try:
                error = spawn_failure(address)
                assert "could not start" in error and "No such file or directory" in error, error
            finally:
                second.terminate()
                second.wait(T)
        finally:
            agent.terminate()
            agent.wait(T)
    assert {event.kind for event in root_events} == {"spawn_failed"}


SESSION_CLIENT = textwrap.dedent("""
    from mesh import this_host
    try:
        this_host()
    except OSError as error:
        print("RESULT", type(error).__name__, error, flush=True)
""")


@pytest.mark.timeout(60)
def test_a_session_that_cannot_start_says_why_and_leaves_nothing(tmp_path: Path) -> None:
    script = tmp_path / "client.py"
    script.write_text(SESSION_CLIENT)
    with client_home() as home:
        deep = home / ("t" * 120)  # a run directory here is too long for the client's socket
        deep.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        result = subprocess.run(
            [sys.executable, str(script)],
            env={**env, "TMPDIR": str(deep)},
            capture_output=True,
            text=True,
            timeout=T,
        )
        assert result.stdout.startswith("RESULT OSError"), result.stdout + result.stderr
        assert "cannot start a meshvisor session" in result.stdout
        assert "TMPDIR" in result.stdout
        assert os.listdir(deep) == [], "the run directory was left behind"


@pytest.mark.timeout(60)
def test_the_run_dir_of_a_killed_daemon_is_swept() -> None:
    with client_home() as home:
        env = {**os.environ, "XDG_RUNTIME_DIR": str(home)}
        killed = subprocess.Popen([*AGENT, "--listen", f"ipc://{home}/a"], env=env)
        wait_until(lambda: list(home.glob("meshvisor-agent-*/owner.pid")), T, "its run dir")
        (stale,) = home.glob("meshvisor-agent-*")
        killed.kill()
        killed.wait(T)
        assert stale.exists()
        address_file = home / "address"
        command = [*AGENT, "--listen", f"ipc://{home}/b"]
        alive = subprocess.Popen([*command, "--address-file", str(address_file)], env=env)
        try:
            wait_until(address_file.exists, T, "the next agent to listen")
            assert not stale.exists(), "the killed daemon's run directory is still there"
            assert len(list(home.glob("meshvisor-agent-*"))) == 1  # its own
        finally:
            alive.terminate()
            alive.wait(T)
        assert not list(home.glob("meshvisor-agent-*"))


@pytest.mark.timeout(120)
def test_stopped_meshes_leave_no_bookkeeping(make_procs: Any) -> None:
    warm = make_procs({"gpus": 1})  # keeps the agent (and what it brings) up meanwhile
    warm.spawn("echo", actors.Echo).echo.call_one(0).get(timeout=T)
    before = mesh.testing.bookkeeping()
    for cycle in range(40):
        procs = this_host().spawn_procs(per_host={"gpus": 2}, name="cycle")
        procs.on_failure(lambda event: False)
        echo = procs.spawn("echo", actors.Echo)
        if cycle % 10 == 0:
            assert echo.echo.call(cycle).get(timeout=T).values() == (cycle, cycle)
        procs.stop().get(timeout=T)
    assert mesh.testing.bookkeeping() == before
    with pytest.raises(SupervisionError, match="stopped"):
        echo.echo.call(1).get(timeout=T)  # a handle to a stopped mesh still says so
    assert procs.respawn().get(timeout=T) is None


@pytest.mark.timeout(60)
def test_allocation_files_drop_agents_that_are_gone() -> None:
    with client_home() as home:
        alloc = home / "alloc"
        alloc.write_text(f"ipc://{home}/never-listened\n")
        run = home / "run"
        run.mkdir(mode=0o700)
        killed, first = start_daemon(home, run, "--allocation", str(alloc))
        wait_until(lambda: killed in alloc.read_text().split(), T, "the agent to join")
        assert alloc.read_text().split() == [killed]
        first.kill()  # its socket file stays behind, refusing connections
        first.wait(T)
        address, second = start_daemon(home, run, "--allocation", str(alloc))
        try:
            wait_until(lambda: address in alloc.read_text().split(), T, "the agent to join")
            assert alloc.read_text().split() == [address]
            assert len(attach(str(alloc))) == 1
        finally:
            second.terminate()
            second.wait(T)
        assert alloc.read_text().split() == [], "a stopped agent leaves its allocation"
