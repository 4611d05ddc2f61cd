"""Hardening: what another local user, or a broken peer, can send meshvisor processes.

Each test plays the adversary with a raw zmq PUSH socket and checks that nothing it sends runs
code (a pickled ``__reduce__`` that would create a marker directory), that nothing it sends
makes the receiver allocate without bound (peak RSS from /proc/PID/status), and that the
receiver keeps serving legitimate calls afterwards.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import pickle
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from actors import Exposed, Sleeper
from conftest import RUN_BASE
from polling import pid_alive, wait_until

import transport
from mesh.testing import local_agent, wire
from transport import (
    MAGIC,
    MAX_HEADER_BYTES,
    Inbox,
    Payload,
    encode,
    new_context,
    private_runtime_dir,
)

T = 30.0
#: Peak RSS a receiver may gain from the hostile frames of one test.
RSS_GROWTH_LIMIT = 150 << 20


class _MakesMarker:
    """Unpickling it creates a directory: proof that a peer's pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return os.mkdir, (self.path,)


def _frame(codec: bytes, header: bytes, body: bytes = b"") -> bytes:
    return MAGIC + struct.pack("<I", len(header)) + codec + header + body


def pickled_header(marker: Path) -> list[bytes]:
    """A frame whose header is a pickle (the codec earlier versions decoded with pickle)."""
    return [_frame(b"p", pickle.dumps(_MakesMarker(marker)))]


def pickled_payload(header: Any, marker: Path) -> list[bytes]:
    """A well-formed header whose payload, once unpickled, runs the attacker's code."""
    frames = encode(header, Payload(pickle.dumps(_MakesMarker(marker))))
    return [bytes(memoryview(f)) for f in frames]


#: 13-byte frames whose marshal header claims 2**31 - 1 items (a tuple, a list) or digits.
BOMBS = [_frame(b"m", code + b"\xff\xff\xff\x7f") for code in (b"(", b"[", b"l", b"<")]


def raw_socket(context: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
    """The adversary: a PUSH socket without any keys."""
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


def peak_rss(pid: int) -> int:
    """The peak resident set size of `pid` (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    context = new_context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def reply_inbox(context: zmq.Context[Any]) -> Iterator[Inbox]:
    """An ipc inbox in a private directory, for answers to the adversary's last message."""
    folder = private_runtime_dir()
    inbox = Inbox(context, f"ipc://{folder}/replies")
    yield inbox
    inbox.close()
    os.rmdir(folder)


def next_header(inbox: Inbox) -> Any:
    """The header of the next valid message `inbox` receives (invalid ones are dropped)."""
    deadline = time.monotonic() + T
    while (envelope := inbox.receive_nowait()) is None:
        remaining = deadline - time.monotonic()
        assert remaining > 0, "no answer came"
        inbox.poll(max(1, int(remaining * 1000)))
    return envelope.header


# -- keyless tcp agents: another user must not run code in the agent, its procs or the client


CLIENT = textwrap.dedent("""
    import sys
    from mesh import Actor, attach, endpoint
    from mesh.testing import inbox_address

    class Address(Actor):
        @endpoint
        def address(self) -> str:
            return inbox_address()

    procs = attach("job").spawn_procs(per_host={"gpus": 1})
    actor = procs.spawn("address", Address)
    print("ADDRESSES", inbox_address(), actor.address.call_one().get(timeout=30),
          flush=True)
    for line in sys.stdin:
        if line.strip() != "call":
            break
        print("CALLED", actor.address.call_one().get(timeout=30), flush=True)
    procs.stop().get(timeout=30)
""")


@pytest.fixture
def keyless_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment of a user who never made keys, with a private MESHVISOR_HOME and run
    directory base (removed afterwards, also what a killed client left there)."""
    env = {k: v for k, v in os.environ.items() if k != transport.KEYS_ENV}
    env["MESHVISOR_HOME"] = str(tmp_path / "home")
    env["XDG_RUNTIME_DIR"] = runs = tempfile.mkdtemp(prefix="sec-", dir=RUN_BASE)
    yield env
    shutil.rmtree(runs, ignore_errors=True)


@pytest.fixture
def keyless_agent(tmp_path: Path, keyless_env: dict[str, str]) -> Iterator[str]:
    """``meshvisor agent --allocation job`` on the default tcp loopback address, no keys given;
    yields its address."""
    (tmp_path / "run").mkdir(mode=0o700)
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "meshvisor", "agent", "--allocation", "job"),
            *("--rundir", str(tmp_path / "run"), "--address-file", str(tmp_path / "address")),
        ],
        env=keyless_env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until((tmp_path / "address").exists, T, "the agent to listen")
        yield (tmp_path / "address").read_text().strip()
        assert agent.poll() is None, "the agent died"
    finally:
        agent.terminate()
        _, log = agent.communicate(timeout=T)
    assert "CURVE keys in" in log, log  # it says where its keys are


@pytest.mark.timeout(120)
def test_another_user_cannot_run_code_in_a_keyless_tcp_allocation(
    tmp_path: Path,
    keyless_env: dict[str, str],
    keyless_agent: str,
    context: zmq.Context[Any],
) -> None:
    keys = tmp_path / "home" / "allocations" / "job.keys"
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert stat.S_IMODE((keys / "allocation.key_secret").stat().st_mode) == 0o600
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    client = subprocess.Popen(
        [sys.executable, str(script)],
        env=keyless_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdin is not None and client.stdout is not None
    try:
        line = client.stdout.readline()
        assert line.startswith("ADDRESSES"), line
        client_address, proc_address = line.split()[1:]
        assert client_address.startswith("tcp://") and proc_address.startswith("tcp://")
        attacks = {
            keyless_agent: [pickled_header(tmp_path / "agent")],
            proc_address: [
                pickled_header(tmp_path / "proc"),
                pickled_payload(
                    wire.SpawnActor("x", "y", "z", (), (), 0), tmp_path / "proc-payload"
                ),
            ],
            client_address: [
                pickled_header(tmp_path / "client"),
                pickled_payload(wire.Reply(1, 0), tmp_path / "client-payload"),
            ],
        }
        markers = [tmp_path / n for n in ("agent", "proc", "client", "proc-payload")]
        markers.append(tmp_path / "client-payload")
        for address, messages in attacks.items():
            _attack(context, address, messages, markers)
        assert not [m.name for m in markers if m.exists()], "a peer without keys ran code"
        client.stdin.write("call\n")
        client.stdin.flush()
        assert client.stdout.readline().split() == ["CALLED", proc_address]
        client.stdin.write("quit\n")
        client.stdin.flush()
        assert client.wait(T) == 0
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(T)
        client.stdin.close()
        client.stdout.close()


def _attack(
    context: zmq.Context[Any], address: str, messages: list[list[bytes]], markers: list[Path]
) -> None:
    """Send `messages` to `address` without keys; return once the receiver refused the
    connection (or, without authentication, once one of the markers appeared)."""
    socket = raw_socket(context, address)
    refused = (
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )
    monitor = socket.get_monitor_socket(refused)
    try:
        for frames in messages:
            with contextlib.suppress(zmq.Again):  # a refused connection takes nothing
                socket.send_multipart(frames, zmq.NOBLOCK)
        wait_until(
            lambda: monitor.poll(0) or any(m.exists() for m in markers),
            T,
            f"{address} to refuse a peer without keys",
        )
    finally:
        socket.disable_monitor()
        monitor.close(0)
        socket.close(0)


def test_attach_to_tcp_addresses_without_keys_says_how_to_pass_them() -> None:
    from mesh import attach
    from mesh.testing import settings

    with (
        settings(curve_keys=None),
        pytest.raises(ValueError, match=f"set {transport.KEYS_ENV}=DIR"),
    ):
        attach(["tcp://127.0.0.1:1"])


def test_a_tcp_agent_without_keys_or_allocation_refuses_to_start(
    tmp_path: Path, keyless_env: dict[str, str]
) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshvisor",
            "agent",
            "--listen",
            "tcp://127.0.0.1:0",
            "--rundir",
            ".",
        ],
        cwd=tmp_path,
        env=keyless_env,
        capture_output=True,
        text=True,
        timeout=T,
    )
    assert done.returncode == 2
    assert "loopback included" in done.stderr and "--allocation NAME" in done.stderr


# -- headers never run code, over ipc either -----------------------------------------------------


def test_inbox_never_unpickles_or_unmarshals_code_in_headers(
    tmp_path: Path, context: zmq.Context[Any], reply_inbox: Inbox
) -> None:
    marker = tmp_path / "marker"
    code = marshal.dumps(compile("import os; os.mkdir(" + repr(str(marker)) + ")", "x", "exec"))
    raw = raw_socket(context, reply_inbox.address)
    try:
        raw.send_multipart(pickled_header(marker))
        raw.send_multipart([_frame(b"m", code)])
        raw.send_multipart([_frame(b"n", code)])
        raw.send_multipart(encode(wire.AgentAlive("after", "the attack")))
        assert next_header(reply_inbox) == wire.AgentAlive("after", "the attack")
    finally:
        raw.close(0)
    assert not marker.exists()


# -- bounded decoding and queues -----------------------------------------------------------------


@pytest.mark.timeout(90)
def test_header_bombs_leave_agent_and_proc_bounded_and_serving(
    make_procs: Any, context: zmq.Context[Any], reply_inbox: Inbox
) -> None:
    """13-byte headers claiming 2**31 items or digits must not make a receiver allocate."""
    pid, address, actor_id = make_procs({"gpus": 1}).spawn("x", Exposed).reach.call_one().get(T)
    agent = local_agent()
    before = {agent.pid: peak_rss(agent.pid), pid: peak_rss(pid)}
    ping = wire.CallActor(7, reply_inbox.address, actor_id, "__ping__", (), (), 0)
    for target, probe in (
        (agent.address, wire.StopProcs(("none",), 0.0, reply_inbox.address)),
        (address, ping),
    ):
        raw = raw_socket(context, target)
        try:
            for bomb in BOMBS:
                raw.send(bomb)
            raw.send_multipart(encode(probe))  # FIFO: answered once the bombs were read
            assert type(next_header(reply_inbox)) in (wire.ProcExited, wire.Reply)
        finally:
            raw.close(0)
    for who, peak in before.items():
        assert peak_rss(who) - peak < RSS_GROWTH_LIMIT, f"pid {who} grew by {peak_rss(who) - peak}"


@pytest.mark.timeout(120)
def test_a_stalled_receiver_queues_a_bounded_number_of_messages(
    make_procs: Any, context: zmq.Context[Any], reply_inbox: Inbox
) -> None:
    """A proc whose loop is busy does not take in everything sent to it: its senders keep
    what it cannot hold yet (nothing is lost), and it catches up afterwards."""
    procs = make_procs({"gpus": 1})
    pid, address, actor_id = procs.spawn("x", Exposed).reach.call_one().get(T)
    sleeper = procs.spawn("sleeper", Sleeper)
    assert sleeper.sleep.call_one(0.0).get(T) == "slept"
    before = peak_rss(pid)
    busy = sleeper.sleep.call_one(5.0)  # its event loop reads nothing meanwhile
    raw = raw_socket(context, address)
    try:
        chunk = encode(wire.AgentAlive("flood", "x"), Payload(b"\0" * (64 << 10)))[0]
        for _ in range(4000):  # 256 MiB, four times what the receive queue may hold
            raw.send(chunk, copy=False)
        ping = wire.CallActor(7, reply_inbox.address, actor_id, "__ping__", (), (), 0)
        raw.send_multipart(encode(ping))
        assert busy.get(T) == "slept"
        assert next_header(reply_inbox) == wire.Reply(7, 0)  # FIFO: it read the whole flood
    finally:
        raw.close(0)
    assert peak_rss(pid) - before < RSS_GROWTH_LIMIT, f"grew by {peak_rss(pid) - before}"
    assert pid_alive(pid)


# -- meshvisor keys: secrets private from the first byte ----------------------------------------


def test_keys_are_private_from_creation_even_with_umask_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With umask 0 the secret must still never exist with group or other bits (each chmod
    is watched: a file written open and chmodded afterwards is caught at that chmod), and an
    existing 0755 directory ends up 0700."""
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)
    seen: list[tuple[str, int]] = []
    chmod = os.chmod

    def watched_chmod(path: Any, mode: int, *args: Any, **kwargs: Any) -> None:
        seen.extend((f.name, stat.S_IMODE(f.stat().st_mode)) for f in directory.iterdir())
        chmod(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "chmod", watched_chmod)
    previous = os.umask(0)
    try:
        transport.CurveKeys.create(directory)
    finally:
        os.umask(previous)
    seen.extend((f.name, stat.S_IMODE(f.stat().st_mode)) for f in directory.iterdir())
    secrets = [mode for name, mode in seen if name.endswith("key_secret")]
    assert secrets and all(mode & 0o077 == 0 for mode in secrets), seen
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


FOLLOWER = textwrap.dedent("""
    import os, sys
    import transport
    transport.follow_keys_pointer(sys.argv[1])
    print(transport.configured_keys() is None, flush=True)
    input()  # the owner points to its keys now
    keys = transport.configured_keys()
    print(keys == transport.CurveKeys.load(sys.argv[2]), os.environ[transport.KEYS_ENV])
""")


def test_a_keyless_process_takes_up_the_keys_its_owner_points_to(tmp_path: Path) -> None:
    """What `attach` does for the local agent and procs that began without keys: the pointer
    file is private from creation (umask 0 too), and a process following it has no keys until
    it is written, then the ones it names, which the processes it starts inherit."""
    rundir, keys = tmp_path / "run", tmp_path / "keys"
    rundir.mkdir(mode=0o700)
    transport.CurveKeys.create(keys)
    env = {k: v for k, v in os.environ.items() if k != transport.KEYS_ENV}
    follower = subprocess.Popen(
        [sys.executable, "-c", FOLLOWER, str(rundir), str(keys)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert follower.stdout is not None and follower.stdin is not None
        assert follower.stdout.readline().strip() == "True"
        previous = os.umask(0)
        try:
            transport.point_to_keys(rundir, str(keys))
        finally:
            os.umask(previous)
        assert [f.name for f in rundir.iterdir()] == ["curve-keys"]
        assert stat.S_IMODE((rundir / "curve-keys").stat().st_mode) == 0o600
        answer, _ = follower.communicate("\n", timeout=T)
        assert answer.split() == ["True", str(keys)]
    finally:
        follower.kill()
        follower.wait(T)


def test_meshvisor_keys_refuses_to_overwrite_or_follow_links(tmp_path: Path) -> None:
    def keys(directory: Path) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "meshvisor", "keys", str(directory)]
        return subprocess.run(command, capture_output=True, text=True, timeout=T)

    assert keys(tmp_path / "keys").returncode == 0
    secret = (tmp_path / "keys" / "allocation.key_secret").read_text()
    again = keys(tmp_path / "keys")
    assert again.returncode == 2 and "already holds CURVE keys" in again.stderr
    assert (tmp_path / "keys" / "allocation.key_secret").read_text() == secret
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    linked = keys(tmp_path / "link")
    assert linked.returncode == 2 and "refusing to keep CURVE keys" in linked.stderr
    assert not list((tmp_path / "elsewhere").iterdir())


def test_an_inbox_refuses_frames_over_the_size_limit_at_the_socket(
    context: zmq.Context[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A frame larger than the message limit plus a header never reaches the receiver: zmq
    disconnects its sender (ZMQ_MAXMSGSIZE) instead of buffering it whole. The sender's next
    message, after it reconnects, arrives."""
    folder = private_runtime_dir()
    inbox = Inbox(context, f"ipc://{folder}/small", max_bytes=1000)
    raw = raw_socket(context, inbox.address)
    try:
        raw.send(b"\0" * (MAX_HEADER_BYTES + 64 * 1024))
        raw.send_multipart(encode(wire.AgentAlive("after", "the big one")))
        assert next_header(inbox) == wire.AgentAlive("after", "the big one")
        assert inbox.receive_nowait() is None
    finally:
        raw.close(0)
        inbox.close()
        os.rmdir(folder)
    assert "message_dropped" not in capsys.readouterr().err  # not even read to be dropped


#: Refused handshakes that would fill a watch's monitor queue at libzmq's default limits.
MONITOR_QUEUE_EVENTS = 2000


@pytest.mark.timeout(180)
def test_a_peer_refusing_us_for_long_never_freezes_the_transport(tmp_path: Path) -> None:
    """A listener with other CURVE keys refuses an outbox's handshakes over and over (zmq keeps
    reconnecting). Past two thousand refusals, libzmq's blocking monitor send used to stop the
    context's I/O thread: no more sends, and closing the outbox waited forever."""
    from zmq.utils.monitor import recv_monitor_message

    others = transport.CurveKeys.create(tmp_path / "other-keys")
    context = new_context()
    server = context.socket(zmq.PULL)
    monitor = None
    outbox = transport.Outbox(context)
    try:
        server.curve_server = True
        server.curve_secretkey, server.curve_publickey = others.secret, others.public
        port = server.bind_to_random_port("tcp://127.0.0.1")
        monitor = server.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        outbox.send(f"tcp://127.0.0.1:{port}", [b"refused"])
        refusals = 0
        deadline = time.monotonic() + 120
        while refusals <= MONITOR_QUEUE_EVENTS + 200:
            assert time.monotonic() < deadline, f"the outbox stopped retrying after {refusals}"
            if monitor.poll(5000):
                recv_monitor_message(monitor)
                refusals += 1
        closing = threading.Thread(target=outbox.close, daemon=True)
        closing.start()
        closing.join(T)
        assert not closing.is_alive(), "closing the outbox waited forever"
    finally:
        if monitor is not None:
            server.disable_monitor()
            monitor.close(linger=0)
        server.close(linger=0)
        outbox.close(linger_ms=0)
        transport.close_context(context)


# -- failed handshakes say what happened: a peer that hung up is not a peer with wrong keys


def _drain_until_logged(watch: Any, err: Any, event: str) -> str:
    """Drain `watch` until `event` is logged on stderr (read through `err`); the text read."""
    logged = ""
    deadline = time.monotonic() + T
    while event not in logged:
        assert time.monotonic() < deadline, f"no {event} was logged: {logged}"
        zmq.select([watch], [], [], 0.1)
        watch.drain()
        logged += err()
    return logged


def test_a_peer_hanging_up_in_the_handshake_is_not_called_a_key_failure(
    context: zmq.Context[Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A tcp inbox logs a peer that connects and closes at once (EOF, or a reset) as having
    hung up, without blaming keys; a peer with other CURVE keys is still logged as refused
    for its keys."""
    inbox = Inbox(context, "tcp://127.0.0.1:0")
    watch = inbox.watch_refusals()
    others = transport.CurveKeys.create(tmp_path / "other-keys")
    wrong = context.socket(zmq.PUSH)
    wrong.setsockopt(zmq.LINGER, 0)
    try:
        host, port = inbox.address.removeprefix("tcp://").rsplit(":", 1)
        for reset in (False, True):
            with socket.create_connection((host, int(port))) as probe:
                if reset:  # close with RST instead of FIN
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        hung_up = _drain_until_logged(watch, lambda: capsys.readouterr().err, "peer_hung_up")
        assert "hung up during the security handshake" in hung_up, hung_up
        assert "CURVE key" not in hung_up and "peer_refused" not in hung_up, hung_up
        wrong.curve_secretkey, wrong.curve_publickey = others.secret, others.public
        wrong.curve_serverkey = others.public
        wrong.connect(inbox.address)
        refused = _drain_until_logged(watch, lambda: capsys.readouterr().err, "peer_refused")
        assert "do not hold the same CURVE keys" in refused, refused
    finally:
        wrong.close(0)
        watch.close()
        inbox.close()
