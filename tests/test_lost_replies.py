"""Answers that cannot reach their caller still end the call (the rule: every call ends).

A daemon agent on this host reached over ipc, started without the allocation's keys or with
other keys, beside a tcp agent that makes the client listen on tcp. Told to hand out its tcp
address (`hand_out_widest_address`), the client gets its answers from the daemon's procs sent
where they cannot arrive; each call must end with an error saying why, not wait forever.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RUN_BASE
from polling import wait_until

import transport

T = 30.0


def _agents(
    tmp_path: Path, daemon_keys: str | None, daemon_env: dict[str, str] | None = None
) -> Iterator[tuple[Path, str]]:
    """(the tcp agent's allocation file, the ipc daemon's address); the daemon holds
    `daemon_keys` (None: no keys) and `daemon_env` on top of ours (its procs inherit it).
    Both are terminated afterwards."""
    alloc, rundir = tmp_path / "hosts", tmp_path / "run"
    rundir.mkdir(mode=0o700)
    folder = Path(RUN_BASE) / f"lost-{time.monotonic_ns() % 10**8}"
    folder.mkdir(mode=0o700)
    tcp = [sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"]
    tcp += ["--rundir", str(rundir), "--allocation", str(alloc)]
    ipc = [sys.executable, "-m", "meshvisor", "agent", "--listen", f"ipc://{folder}/agent"]
    ipc += ["--rundir", str(folder), "--address-file", str(folder / "address")]
    # the client names itself by its tcp address while it hands that out: not an owner gone
    ipc += ["--owner-timeout", "60"]
    env = {k: v for k, v in os.environ.items() if k != transport.KEYS_ENV} | (daemon_env or {})
    if daemon_keys is not None:
        env[transport.KEYS_ENV] = daemon_keys
    agents = [
        subprocess.Popen(tcp, stderr=subprocess.DEVNULL),
        subprocess.Popen(ipc, env=env, stderr=subprocess.DEVNULL),
    ]
    try:
        wait_until(lambda: alloc.exists() and (folder / "address").exists(), T, "the agents")
        yield alloc, (folder / "address").read_text().strip()
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.wait(T)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def keyless_daemon(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    yield from _agents(tmp_path, None)


@pytest.fixture
def other_keys_daemon(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    keys = tmp_path / "other-keys"
    transport.CurveKeys.create(str(keys))
    yield from _agents(tmp_path, str(keys))


@pytest.fixture
def impatient_other_keys_daemon(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """`other_keys_daemon` whose procs refuse calls to actors they do not know after 1 s
    (not 30: the test needs no more; nothing it sends races a spawn)."""
    keys = tmp_path / "other-keys"
    transport.CurveKeys.create(str(keys))
    yield from _agents(tmp_path, str(keys), {"MESHVISOR_EARLY_MESSAGE_WAIT_S": "1"})


CLIENT = """
    from mesh import Actor, attach, endpoint
    from mesh.testing import hand_out_widest_address
    from supervision import SupervisionError

    class Echo(Actor):
        @endpoint
        def length(self, data: bytes) -> int:
            return len(data)

    def outcome(call) -> str:
        try:
            return str(call.get(timeout=15))  # before the agent timeout (20 s)
        except SupervisionError as error:
            return "FAILED " + str(error).replace(chr(10), " ")
        except TimeoutError:
            return "NO ANSWER"

    attach({alloc!r}).spawn_procs(per_host={{"gpus": 1}})  # the client listens on tcp
    daemon = attach([{daemon!r}])
    procs = daemon.spawn_procs(per_host={{"gpus": 1}}{spawn_options})
    echo = procs.spawn("echo", Echo)
    print("FIRST", outcome(echo.length.call_one(b"x")), flush=True)
    with hand_out_widest_address():  # its answers go to tcp, which it cannot reach
        for i in range(2):
            print("LOST", outcome(echo.length.call_one(b"lost")), flush=True)
    print("AGAIN", outcome(echo.length.call_one(b"xy")), flush=True)
    with hand_out_widest_address():  # its acknowledgement cannot arrive either
        print("STOPPED", outcome(echo.stop()), flush=True)
    procs.stop().get(timeout=20)
"""


def _run(tmp_path: Path, alloc: Path, daemon: str, spawn_options: str) -> list[str]:
    """The client's lines (FIRST, LOST twice, AGAIN, STOPPED), checked to have ended as they
    must."""
    script = tmp_path / "client.py"
    fields = {"alloc": str(alloc), "daemon": daemon, "spawn_options": spawn_options}
    script.write_text(textwrap.dedent(CLIENT).format(**fields))
    env = os.environ | {"MESHVISOR_AGENT_TIMEOUT_S": "20"}  # a busy machine is no lost agent
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=150
    )
    lines = [line for line in done.stdout.splitlines() if line.split()[0].isupper()]
    assert [line.split()[0] for line in lines] == ["FIRST", "LOST", "LOST", "AGAIN", "STOPPED"], (
        done.stdout + done.stderr
    )
    assert lines[0] == "FIRST 1" and lines[3] == "AGAIN 2", done.stdout + done.stderr
    # a stop whose acknowledgement is lost still ends (it did stop the actors)
    assert lines[4] == "STOPPED None", done.stdout + done.stderr
    return lines[1:3]


@pytest.mark.timeout(180)
def test_an_answer_from_a_detached_mesh_that_cannot_reach_its_caller_ends_the_call(
    tmp_path: Path, keyless_daemon: tuple[Path, str]
) -> None:
    """The actors of a detached mesh report to their agent, not to the client: a lost answer
    goes there too, and the agent hands it to the mesh's owner, which ends the call."""
    alloc, daemon = keyless_daemon
    for lost in _run(tmp_path, alloc, daemon, ', name="kept", detached=True'):
        for part in ("FAILED", "became unreachable", "'length'", "could not be sent from proc"):
            assert part in lost, lost


@pytest.mark.timeout(180)
def test_an_answer_refused_by_its_caller_for_other_keys_ends_the_call(
    tmp_path: Path, other_keys_daemon: tuple[Path, str]
) -> None:
    """A proc holding other CURVE keys than its caller: zmq takes its answer and keeps it
    while the caller refuses every handshake. The proc sees the refusal and tells the actor's
    owner, which ends the call with an error naming the keys (each call, not only the first)."""
    alloc, daemon = other_keys_daemon
    for lost in _run(tmp_path, alloc, daemon, ""):
        for part in ("FAILED", "became unreachable", "'length'", "refused", "CURVE keys"):
            assert part in lost, lost


ASKING = """
    import sys, time
    from pathlib import Path
    from mesh import Actor, attach, endpoint
    from supervision import SupervisionError

    class Echo(Actor):
        @endpoint
        def slow_length(self, data: bytes, go: str) -> int:
            deadline = time.monotonic() + 60
            while go and not Path(go).exists() and time.monotonic() < deadline:
                time.sleep(0.01)  # until the test says: its caller's owner is gone by then
            return len(data)

    class Asker(Actor):
        def __init__(self) -> None:
            self.outcome = "NOT ASKED"

        @endpoint
        def ask(self, other, go: str) -> str:
            if go:
                Path(go + ".asked").touch()
            try:
                self.outcome = str(other.slow_length.call_one(b"xyz", go).get(timeout=30))
            except SupervisionError as error:
                self.outcome = "FAILED " + str(error).replace(chr(10), " ")
            except TimeoutError:
                self.outcome = "NO ANSWER"
            return self.outcome

        @endpoint
        def last(self) -> str:
            return self.outcome
"""

SPAWNING = """
    tcp, daemon = attach({alloc!r}), attach([{daemon!r}])
    kept = daemon.spawn_procs(per_host={{"gpus": 1}}, name="kept", detached=True)
    callers = tcp.spawn_procs(per_host={{"gpus": 1}}, name="callers", detached=True)
    asker = callers.spawn("asker", Asker)
    print("FIRST", asker.ask.call_one(kept.spawn("echo", Echo), "").get(timeout=30), flush=True)
    asker.ask.broadcast(kept.actor_mesh("echo"), {go!r})  # answered once this client is gone
    deadline = time.monotonic() + 30
    while not Path({go!r} + ".asked").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
"""

ADOPTING = """
    tcp, daemon = attach({alloc!r}), attach([{daemon!r}])
    deadline, kept = time.monotonic() + 30, 0
    while kept == 0 and time.monotonic() < deadline:  # the lost answer, kept for an adopter
        infos = [info for info in daemon.detached_meshes() if info.name == "kept"]
        kept = infos[0].kept_failures if infos else 0
        time.sleep(0.05)
    print("KEPT", kept, flush=True)
    kept_procs, callers = daemon.adopt_procs("kept"), tcp.adopt_procs("callers")
    print("ASKED", callers.actor_mesh("asker").last.call_one().get(timeout=60), flush=True)
    kept_procs.stop().get(timeout=20)
    callers.stop().get(timeout=20)
"""


@pytest.mark.timeout(180)
def test_an_answer_lost_while_a_detached_mesh_has_no_owner_reaches_its_caller_via_the_adopter(
    tmp_path: Path, keyless_daemon: tuple[Path, str]
) -> None:
    """A tcp proc calls an actor of a detached mesh on a keyless host, whose answer cannot
    reach it (no keys), after the client that owned both meshes ended. The agent keeps the
    lost answer like a failure; the client that adopts the mesh forwards it with its keys,
    so the tcp proc's call ends with the reason, not its timeout."""
    alloc, daemon = keyless_daemon
    go = tmp_path / "go"
    fields = {"alloc": str(alloc), "daemon": daemon, "go": str(go)}
    spawned = _client(tmp_path / "spawning.py", ASKING + SPAWNING, fields)
    # while the client owns the mesh, it forwards the lost answer (through the agent)
    (first,) = [line for line in spawned.stdout.splitlines() if line.startswith("FIRST")] or [
        spawned.stdout + spawned.stderr
    ]
    assert "FIRST FAILED" in first and "could not be sent from proc" in first, first
    go.touch()  # the answer goes now: its caller's owner has ended
    adopted = _client(tmp_path / "adopting.py", ASKING + ADOPTING, fields)
    lines = adopted.stdout.splitlines()
    # kept: this one, and the first (at-least-once: sent to an owner that was found gone)
    assert "KEPT 0" not in lines, adopted.stdout + adopted.stderr
    (asked,) = [line for line in lines if line.startswith("ASKED")] or [adopted.stderr]
    for part in ("FAILED", "'slow_length'", "could not be sent from proc", "CURVE"):
        assert part in asked, asked


def _client(
    script: Path, source: str, fields: dict[str, str], agent_timeout_s: float = 20.0
) -> subprocess.CompletedProcess[str]:
    script.write_text(textwrap.dedent(source).format(**fields))
    # a busy machine is no lost agent
    env = os.environ | {"MESHVISOR_AGENT_TIMEOUT_S": str(agent_timeout_s)}
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )


UNKNOWN = """
    from mesh import Actor, attach, endpoint
    from mesh.testing import hand_out_widest_address
    from supervision import SupervisionError

    class Echo(Actor):
        @endpoint
        def length(self, data: bytes) -> int:
            return len(data)

    attach({alloc!r}).spawn_procs(per_host={{"gpus": 1}})  # the client listens on tcp
    procs = attach([{daemon!r}]).spawn_procs(per_host={{"gpus": 1}})
    echo = procs.spawn("echo", Echo)
    echo.length.call_one(b"x").get(timeout=30)
    rebuild, fields = echo.__reduce__()  # a handle of actors that were never spawned there
    unknown = rebuild(fields[0], fields[1] + "-never-spawned", *fields[2:])
    with hand_out_widest_address():  # the refusal cannot reach the client
        try:  # refused once the proc gave up waiting for the actor (1 s on this daemon)
            print("UNKNOWN", unknown.length.call_one(b"lost").get(timeout=45), flush=True)
        except SupervisionError as error:
            print("UNKNOWN FAILED", str(error).replace(chr(10), " "), flush=True)
        except TimeoutError:
            print("UNKNOWN NO ANSWER", flush=True)
    procs.stop().get(timeout=20)
"""


@pytest.mark.timeout(180)
def test_a_refusal_of_a_call_to_an_unknown_actor_that_cannot_reach_its_caller_ends_it(
    tmp_path: Path, impatient_other_keys_daemon: tuple[Path, str]
) -> None:
    """A call to actors its proc does not know is refused once the proc stops waiting for
    their spawn; a refusal that cannot reach its caller has no actor owner to go to: the proc
    tells its agent, which hands it to the proc's owner, which ends the call saying why."""
    alloc, daemon = impatient_other_keys_daemon
    fields = {"alloc": str(alloc), "daemon": daemon}
    # the daemon's answers to the client's keep-alive are refused too: it must outlast them
    done = _client(tmp_path / "unknown.py", UNKNOWN, fields, agent_timeout_s=100.0)
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("UNKNOWN")] or [
        done.stdout + done.stderr
    ]
    for part in ("UNKNOWN FAILED", "'length'", "could not be sent from proc", "CURVE keys"):
        assert part in line, line


FANNED = """
    from mesh import Actor, attach, endpoint
    from mesh.testing import fan_out_from, fanned_out, hand_out_widest_address
    from supervision import SupervisionError

    class Echo(Actor):
        @endpoint
        def length(self, data: bytes) -> int:
            return len(data)

    attach({alloc!r}).spawn_procs(per_host={{"gpus": 1}})  # the client listens on tcp
    procs = attach([{daemon!r}]).spawn_procs(per_host={{"gpus": 4}})
    echo = procs.spawn("echo", Echo)
    print("FIRST", sum(echo.length.call(b"x").get(timeout=30).values()), flush=True)
    with fan_out_from(2), hand_out_widest_address():  # through the agent, which has no keys
        try:
            print("FANNED", echo.length.call(b"lost").get(timeout=15).values(), flush=True)
        except SupervisionError as error:
            print("FANNED FAILED", str(error).replace(chr(10), " "), flush=True)
        except TimeoutError:
            print("FANNED NO ANSWER", flush=True)
        print("VIA AGENT", all(fanned_out(echo)), flush=True)
    procs.stop().get(timeout=20)
"""


@pytest.mark.timeout(180)
def test_answers_of_a_fanned_out_call_that_its_agent_cannot_send_on_end_the_call(
    tmp_path: Path, keyless_daemon: tuple[Path, str]
) -> None:
    """A call fanned out through a keyless host agent to a caller on tcp: the agent cannot
    send the answers on; it tells the procs' owner (`ReplyLost`), which ends the call."""
    alloc, daemon = keyless_daemon
    done = _client(tmp_path / "fanned.py", FANNED, {"alloc": str(alloc), "daemon": daemon})
    lines = done.stdout.splitlines()
    assert "FIRST 4" in lines and "VIA AGENT True" in lines, done.stdout + done.stderr
    (fanned,) = [line for line in lines if line.startswith("FANNED")] or [done.stderr]
    for part in ("FANNED FAILED", "'length'", "its host agent", "could not send it on"):
        assert part in fanned, fanned


UNKNOWN_HERE = """
    from mesh import Actor, endpoint, this_host
    from supervision import SupervisionError

    class Echo(Actor):
        @endpoint
        def length(self, data: bytes) -> int:
            return len(data)

    echo = this_host().spawn_procs(per_host={"gpus": 1}).spawn("echo", Echo)
    echo.length.call_one(b"x").get(timeout=30)
    rebuild, fields = echo.__reduce__()  # a handle of actors that were never spawned there
    unknown = rebuild(fields[0], fields[1] + "-never-spawned", *fields[2:])
    try:
        print("UNKNOWN", unknown.length.call_one(b"x").get(timeout=60), flush=True)
    except SupervisionError as error:
        print("UNKNOWN FAILED", str(error).replace(chr(10), " "), flush=True)
    except TimeoutError:
        print("UNKNOWN NO ANSWER", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_call_to_an_actor_its_proc_does_not_know_is_refused_after_the_wait_set() -> None:
    """MESHVISOR_EARLY_MESSAGE_WAIT_S (here 0.5 s, reaching the procs through the local
    agent) bounds how long a proc keeps a call for an actor whose spawn has not come."""
    env = os.environ | {"MESHVISOR_EARLY_MESSAGE_WAIT_S": "0.5"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(UNKNOWN_HERE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("UNKNOWN")] or [
        done.stdout + done.stderr
    ]
    for part in ("UNKNOWN FAILED", "never spawned here", "within 0.5 s"):
        assert part in line, line


@pytest.mark.timeout(180)
def test_answers_of_a_fanned_out_call_that_its_caller_refuses_end_the_call(
    tmp_path: Path, other_keys_daemon: tuple[Path, str]
) -> None:
    """A call fanned out through a host agent holding other CURVE keys than its caller (on
    tcp): zmq takes the answers the agent sends on and keeps them while the caller refuses
    every handshake. The agent sees the refusal and tells the procs' owner, which ends the
    call saying why, instead of leaving it to its timeout."""
    alloc, daemon = other_keys_daemon
    done = _client(tmp_path / "fanned.py", FANNED, {"alloc": str(alloc), "daemon": daemon})
    lines = done.stdout.splitlines()
    assert "FIRST 4" in lines and "VIA AGENT True" in lines, done.stdout + done.stderr
    (fanned,) = [line for line in lines if line.startswith("FANNED")] or [done.stderr]
    for part in ("FANNED FAILED", "'length'", "its host agent", "refused", "CURVE keys"):
        assert part in fanned, fanned
