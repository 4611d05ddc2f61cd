"""Persistent allocations: daemon host agents over tcp on loopback, attached to as hosts.

Each agent here is a real ``python -m meshvisor agent`` daemon listening on 127.0.0.1; two of them
play two hosts. Clients that attach and then die (even by SIGKILL) lose their procs after the
agents' owner timeout, while the agents stay up for the next client.
"""

from __future__ import annotations

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
from actors import Where
from conftest import RUN_BASE
from polling import pid_alive, wait_until

from mesh import attach
from supervision import SupervisionError

T = 30.0
OWNER_TIMEOUT_S = 1.0


@pytest.fixture
def allocation() -> Iterator[tuple[Path, list[int]]]:
    """Two daemon agents in one allocation file; yields the file and the agents' pids in the
    file's order (host 0, host 1). The agents are terminated after the test."""
    folder = Path(RUN_BASE) / f"alloc-{time.monotonic_ns()}"
    folder.mkdir()
    alloc = folder / "hosts"
    for i in range(2):
        (folder / f"run{i}").mkdir(mode=0o700)
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshvisor",
                "agent",
                "--listen",
                "tcp://127.0.0.1:0",
                "--rundir",
                str(folder / f"run{i}"),
                "--address-file",
                f"{folder}/agent{i}",
                "--allocation",
                str(alloc),
                "--owner-timeout",
                str(OWNER_TIMEOUT_S),
            ]
        )
        for i in range(2)
    ]
    try:
        wait_until(
            lambda: alloc.exists() and len(alloc.read_text().split()) == 2,
            T,
            "both agents to join the allocation",
        )
        pid_of = {(folder / f"agent{i}").read_text().strip(): agents[i].pid for i in range(2)}
        yield alloc, [pid_of[address] for address in alloc.read_text().split()]
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.wait(T)
        shutil.rmtree(folder, ignore_errors=True)  # a killed agent cannot clean up itself


def test_two_agents_are_two_hosts(allocation: tuple[Path, list[int]]) -> None:
    alloc, _ = allocation
    hosts = attach(str(alloc))
    assert hosts.sizes == {"hosts": 2}
    procs = hosts.spawn_procs(per_host={"gpus": 2})
    try:
        events = []
        procs.on_failure(lambda event: events.append(event) or True)
        where = procs.spawn("where", Where)
        points = [point for _, point in where.where.call().get(timeout=T).values()]
        assert points == [{"hosts": h, "gpus": g} for h in range(2) for g in range(2)]
        victim = where.slice(hosts=1, gpus=0)
        pid = victim.where.call_one().get(timeout=T)[0]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(SupervisionError, match="SIGKILL"):
            wait_until(lambda: bool(events), T, "the owner to hear of the kill")
            victim.where.call_one().get(timeout=T)
        assert events[0].kind == "signal" and dict(events[0].rank) == {"hosts": 1, "gpus": 0}
        assert where.slice(hosts=0).where.call().get(timeout=T)  # the other host is fine
    finally:
        procs.stop().get(timeout=T)


CLIENT = textwrap.dedent("""
    import os, time
    from mesh import Actor, attach, current_rank, endpoint

    class Where(Actor):
        @endpoint
        def where(self):
            return os.getpid(), dict(current_rank())

    procs = attach({alloc!r}).spawn_procs(per_host={{"gpus": 1}})
    pids = [pid for pid, _ in procs.spawn("w", Where).where.call().get(timeout=30).values()]
    print("PIDS", *pids, flush=True)
    time.sleep(60)
""")


def test_allocation_outlives_a_sigkilled_client(
    allocation: tuple[Path, list[int]], tmp_path: Path
) -> None:
    alloc, agent_pids = allocation
    script = tmp_path / "client.py"
    script.write_text(CLIENT.format(alloc=str(alloc)))
    client = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = client.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("PIDS"), line
        proc_pids = [int(pid) for pid in line.split()[1:]]
        assert len(proc_pids) == 2 and all(pid_alive(pid) for pid in proc_pids)
        client.kill()
        client.wait(T)
        killed_at = time.monotonic()
        wait_until(
            lambda: not any(pid_alive(pid) for pid in proc_pids),
            T,
            "the dead client's procs to be reaped",
        )
        assert time.monotonic() - killed_at < OWNER_TIMEOUT_S + 5
        assert all(pid_alive(pid) for pid in agent_pids), "the agents must outlive the client"
    finally:
        client.kill()
        client.wait(T)
        client.stdout.close()  # type: ignore[union-attr]
    stale = [d for d in Path(RUN_BASE).glob("meshvisor-*") if _owner(d) == client.pid]
    assert len(stale) == 1, "a SIGKILLed client cannot remove its run directory"
    # A new client attaches to the same allocation and spawns again; starting, it removes the
    # run directory the killed client left.
    again = tmp_path / "again.py"
    again.write_text(CLIENT.format(alloc=str(alloc)).replace("time.sleep(60)", ""))
    done = subprocess.run([sys.executable, str(again)], capture_output=True, text=True, timeout=T)
    assert done.returncode == 0 and len(done.stdout.split()) == 3, (done.stdout, done.stderr)
    assert not stale[0].exists()


def _owner(rundir: Path) -> int | None:
    """The pid named in a client's run directory (None if there is none)."""
    try:
        return int((rundir / "owner.pid").read_text())
    except (OSError, ValueError):
        return None


def test_a_lost_agent_makes_its_procs_unreachable(allocation: tuple[Path, list[int]]) -> None:
    """A daemon agent killed outright takes its procs with it; the client notices the
    silence (no pid to watch across hosts) and reports each rank as unreachable."""
    alloc, agent_pids = allocation
    procs = attach(str(alloc)).spawn_procs(per_host={"gpus": 1})
    try:
        events = []
        procs.on_failure(lambda event: events.append(event) or True)
        where = procs.spawn("where", Where)
        assert len(where.where.call().get(timeout=T)) == 2
        os.kill(agent_pids[1], signal.SIGKILL)
        wait_until(lambda: bool(events), T, "the lost agent to be noticed")
        assert [e.kind for e in events] == ["unreachable"]
        assert dict(events[0].rank) == {"hosts": 1, "gpus": 0}
        assert "host agent" in str(events[0])
        with pytest.raises(SupervisionError, match="unreachable"):
            where.slice(hosts=1).where.call_one().get(timeout=T)
        assert where.slice(hosts=0).where.call_one().get(timeout=T)  # the other host is fine
    finally:
        procs.stop().get(timeout=T)


def test_attach_explains_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no allocation"):
        attach(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not an agent address"):
        attach(["localhost:5555"])
    with pytest.raises(ValueError, match="at least one"):
        attach([])


KEYED_CLIENT = textwrap.dedent("""
    from mesh import Actor, attach, endpoint

    class Hello(Actor):
        @endpoint
        def hello(self) -> str:
            return "hello"

    try:
        procs = attach([{address!r}]).spawn_procs(per_host={{"gpus": 1}})
        print("RESULT", procs.spawn("hello", Hello).hello.call_one().get(timeout=20))
    except Exception as error:  # the failure is what the test looks at
        print("RESULT", type(error).__name__)
        print("MESSAGE", error)
""")


def test_curve_keys_admit_members_and_refuse_others(tmp_path: Path) -> None:
    """An agent started with the allocation's CURVE keys serves clients holding them and
    refuses, with a logged reason, clients with other keys; the refused client is told why
    (not only "no answer"). A client without keys is refused before it sends anything."""
    keys, others = tmp_path / "keys", tmp_path / "other-keys"
    for directory in (keys, others):
        subprocess.run(
            [sys.executable, "-m", "meshvisor", "keys", str(directory)],
            check=True,
            capture_output=True,
        )
    address_file = tmp_path / "address"
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshvisor",
            "agent",
            "--listen",
            "tcp://127.0.0.1:0",
            "--keys",
            str(keys),
            "--address-file",
            str(address_file),
            "--rundir",
            str(tmp_path),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(address_file.exists, T, "the agent to listen")
        script = tmp_path / "client.py"
        script.write_text(KEYED_CLIENT.format(address=address_file.read_text().strip()))

        def run(keys_dir: Path | None) -> tuple[str, str]:
            env = {k: v for k, v in os.environ.items() if k != "MESHVISOR_CURVE_KEYS"}
            if keys_dir is not None:
                env["MESHVISOR_CURVE_KEYS"] = str(keys_dir)
            done = subprocess.run(
                [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60
            )
            lines = done.stdout.splitlines()
            result = next((x for x in lines if x.startswith("RESULT")), done.stdout + done.stderr)
            return result, next((x for x in lines if x.startswith("MESSAGE")), "")

        assert run(keys)[0] == "RESULT hello"
        result, message = run(others)
        assert result == "RESULT SupervisionError", message
        assert "unreachable" in message and "refused this process" in message, message
        assert "CURVE keys" in message and str(others) in message, message
        result, message = run(None)
        assert result == "RESULT ValueError", message
        assert "MESHVISOR_CURVE_KEYS=DIR" in message, message
    finally:
        agent.terminate()
        _, log = agent.communicate(timeout=T)
    assert "peer_refused" in log and "CURVE keys" in log, log


def test_stopping_a_proc_the_agent_does_not_know_is_answered(
    allocation: tuple[Path, list[int]],
) -> None:
    """A stop for a proc the agent never ran (it ran under a previous agent at the same
    address) is answered as stopped, so the owner's stop() never waits for nothing."""
    from mesh.testing import wire
    from transport import Inbox, Outbox, close_context, encode, new_context

    agent = allocation[0].read_text().split()[0]
    context = new_context()
    inbox = Inbox(context, "tcp://127.0.0.1:*")
    outbox = Outbox(context)
    try:
        outbox.send(agent, encode(wire.StopProcs(("gone-proc",), 0.0, inbox.address)))
        assert inbox.poll(int(T * 1000)), "the agent did not answer"
        envelope = inbox.receive_nowait()
        assert envelope is not None
        report = envelope.header
        assert isinstance(report, wire.ProcExited)
        assert report.proc_id == "gone-proc" and report.requested
    finally:
        outbox.close(0)
        inbox.close()
        close_context(context)


MIXED_CLIENT = textwrap.dedent("""
    import os, signal
    from mesh import Actor, attach, endpoint, this_host
    from supervision import SupervisionError

    class Echo(Actor):
        @endpoint
        def length(self, data: bytes) -> int:
            return len(data)

        @endpoint
        def pid(self) -> int:
            return os.getpid()

    LARGE = b"x" * (4 << 20)  # sent as a shared payload file
    try:
        early = this_host().spawn_procs(per_host={{"gpus": 1}})  # the local agent: no keys
        before = early.spawn("before", Echo)
        print("BEFORE", before.length.call_one(b"x").get(timeout=15), flush=True)
        remote = attach({alloc!r}).spawn_procs(per_host={{"gpus": 1}}).spawn("remote", Echo)
        print("REMOTE", remote.length.call_one(b"xy").get(timeout=15), flush=True)
        print("EARLY", before.length.call_one(LARGE).get(timeout=15), flush=True)
        late_procs = this_host().spawn_procs(per_host={{"gpus": 1}})
        late_procs.on_failure(lambda event: True)
        late = late_procs.spawn("late", Echo)
        print("LATE", late.length.call_one(LARGE).get(timeout=15), flush=True)
        os.kill(late.pid.call_one().get(timeout=15), signal.SIGKILL)
        try:
            late.pid.call_one().get(timeout=15)
        except SupervisionError as error:
            print("KILLED", "SIGKILL" in str(error), flush=True)
    except Exception as error:  # the failure is what the test looks at
        print("ERROR", type(error).__name__, error, flush=True)
""")


@pytest.mark.timeout(120)
def test_local_procs_work_beside_attached_tcp_agents(tmp_path: Path) -> None:
    """A client whose local agent started without keys attaches to a tcp allocation (whose
    keys it takes up, and whose address it now answers on): its local procs, those spawned
    before attach and after, still reach it with small and large values and exit reports,
    instead of failing to authenticate and leaving every call to them hanging."""
    env = {k: v for k, v in os.environ.items() if k != "MESHVISOR_CURVE_KEYS"}
    alloc, rundir = tmp_path / "hosts", tmp_path / "run"
    rundir.mkdir(mode=0o700)
    command = [sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"]
    command += ["--rundir", str(rundir), "--allocation", str(alloc)]
    agent = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    try:
        wait_until(alloc.exists, T, "the agent to join the allocation")
        script = tmp_path / "client.py"
        script.write_text(MIXED_CLIENT.format(alloc=str(alloc)))
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90
        )
    finally:
        agent.terminate()
        agent.wait(T)
    lines = [line for line in done.stdout.splitlines() if line.split()[0].isupper()]
    sizes = [str(1), str(2), str(4 << 20), str(4 << 20)]
    expected = [f"{w} {s}" for w, s in zip(("BEFORE", "REMOTE", "EARLY", "LATE"), sizes)]
    assert lines == [*expected, "KILLED True"], done.stdout + done.stderr


IPC_DAEMON_CLIENT = textwrap.dedent("""
    import time
    from mesh import Actor, Channel, attach, endpoint
    from mesh.testing import hand_out_widest_address
    from supervision import SupervisionError

    class Echo(Actor):
        @endpoint
        def length(self, data: bytes) -> int:
            return len(data)

        @endpoint
        def tell(self, port, value: int) -> None:
            port.send(value)

        @endpoint
        def ask(self, other) -> str:  # a proc on a tcp agent calls a keyless local proc
            try:
                return str(other.length.call_one(b"ab").get())  # no timeout: it must end
            except SupervisionError as error:
                return "FAILED " + str(error).replace(chr(10), " ")

        @endpoint
        def fail_soon(self) -> None:
            time.sleep(0.5)
            raise Abort("on purpose")  # a BaseException: the actor fails

        @endpoint
        def ask_failing(self, other) -> str:  # its answers cannot come: failures, not values
            calls = [other.fail_soon.call_one(), other.length.call_one(b"queued behind")]
            return " | ".join(_outcome(call) for call in calls)

    class Abort(BaseException):
        pass

    def _outcome(call) -> str:
        try:
            return str(call.get(timeout=20))
        except SupervisionError as error:
            return "FAILED " + str(error).replace(chr(10), " ")
        except TimeoutError:
            return "NO ANSWER"

    LARGE = b"x" * (4 << 20)  # sent as a shared payload file
    try:
        daemon = attach([{daemon!r}])  # a keyless agent on this host, reached over ipc
        before = daemon.spawn_procs(per_host={{"gpus": 1}}).spawn("before", Echo)
        print("BEFORE", before.length.call_one(b"x").get(timeout=15), flush=True)
        remote = attach({alloc!r}).spawn_procs(per_host={{"gpus": 1}}).spawn("remote", Echo)
        print("REMOTE", remote.length.call_one(b"xy").get(timeout=15), flush=True)
        print("AFTER", before.length.call_one(LARGE).get(timeout=15), flush=True)
        late = daemon.spawn_procs(per_host={{"gpus": 1}}).spawn("late", Echo)
        print("LATE", late.length.call(b"xyz").get(timeout=15).item(hosts=0, gpus=0), flush=True)
        port, receiver = Channel.open()  # a port goes anywhere: its holder picks the address
        late.tell.call_one(port, 5).get(timeout=15)
        remote.tell.call_one(port, 6).get(timeout=15)
        print("PORT", sorted(receiver.recv().get(timeout=15) for _ in range(2)), flush=True)
        print("ASKED", remote.ask.call_one(before).get(timeout=30), flush=True)
        doomed = daemon.spawn_procs(per_host={{"gpus": 1}}).spawn("doomed", Echo)
        doomed.on_failure(lambda event: True)  # its failure is expected: handled
        print("QUEUED", remote.ask_failing.call_one(doomed).get(timeout=60), flush=True)
        with hand_out_widest_address():  # its replies go to tcp, which it has no keys for
            try:
                before.length.call_one(b"lost").get()  # no timeout: it must end by itself
            except SupervisionError as error:
                print("LOST", str(error).replace(chr(10), " "), flush=True)
        print("AGAIN", before.length.call_one(b"xyzw").get(timeout=15), flush=True)
    except Exception as error:  # the failure is what the test looks at
        print("ERROR", type(error).__name__, error, flush=True)
""")


@pytest.mark.timeout(120)
def test_a_keyless_ipc_daemon_beside_tcp_agents_reaches_the_client(tmp_path: Path) -> None:
    """A daemon agent on this host started without keys (reached over ipc) beside an attached
    tcp allocation: its procs, spawned before the client listens on tcp and after, are handed
    the client's ipc address, so every call to them answers, and a channel's port reaches the
    client from them (ipc) and from a remote proc (tcp). And a reply that cannot reach its
    caller still ends the call, with an error naming the proc, the endpoint and why, instead
    of a wait forever: the client's own call (the client handing out its tcp address to such
    a proc), and a remote proc's (tcp only), which the client, the actor's owner, tells."""
    env = {k: v for k, v in os.environ.items() if k != "MESHVISOR_CURVE_KEYS"}
    alloc, rundir = tmp_path / "hosts", tmp_path / "run"
    rundir.mkdir(mode=0o700)
    folder = Path(RUN_BASE) / f"ipcd-{time.monotonic_ns()}"
    folder.mkdir(mode=0o700)
    tcp = [sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"]
    tcp += ["--rundir", str(rundir), "--allocation", str(alloc)]
    ipc = [sys.executable, "-m", "meshvisor", "agent", "--listen", f"ipc://{folder}/agent"]
    ipc += ["--rundir", str(folder), "--address-file", str(folder / "address")]
    agents = [subprocess.Popen(c, env=env, stderr=subprocess.DEVNULL) for c in (tcp, ipc)]
    try:
        wait_until(lambda: alloc.exists() and (folder / "address").exists(), T, "the agents")
        script = tmp_path / "client.py"
        daemon = (folder / "address").read_text().strip()
        script.write_text(IPC_DAEMON_CLIENT.format(alloc=str(alloc), daemon=daemon))
        slow = env | {"MESHVISOR_AGENT_TIMEOUT_S": "20"}  # a busy machine is no lost agent
        done = subprocess.run(
            [sys.executable, str(script)], env=slow, capture_output=True, text=True, timeout=90
        )
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.wait(T)
        shutil.rmtree(folder, ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.split()[0].isupper()]
    answers = [line for line in lines if not line.startswith(("LOST", "ASKED", "QUEUED"))]
    expected = ["BEFORE 1", "REMOTE 2", f"AFTER {4 << 20}", "LATE 3", "PORT [5, 6]", "AGAIN 4"]
    assert answers == expected, done.stdout + done.stderr
    for lost in [line for line in lines if line.startswith(("LOST", "ASKED"))] or [""]:
        for part in ("became unreachable", "'length'", "could not be sent from proc", "CURVE"):
            assert part in lost, done.stdout + done.stderr
    assert len([line for line in lines if line.startswith(("LOST", "ASKED"))]) == 2, lines
    # the failures of a call whose actor failed, and of one queued behind it, reach a caller
    # they cannot be sent to through the actor's owner (they would never come)
    (queued,) = [line for line in lines if line.startswith("QUEUED")] or [done.stdout]
    for outcome in queued.removeprefix("QUEUED ").split(" | "):
        assert outcome.startswith("FAILED") and "'fail_soon' raised Abort" in outcome, queued


QUIET_STOP_CLIENT = textwrap.dedent("""
    import time
    from mesh import Actor, attach, endpoint, this_host

    class Slow(Actor):
        @endpoint
        def nap(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    hosts = attach({alloc!r})
    hosts.spawn_procs(per_host={{"gpus": 2}}).stop().get(timeout=30)  # stopped while starting
    remote = hosts.spawn_procs(per_host={{"gpus": 2}}).spawn("remote", Slow)
    local = this_host().spawn_procs(per_host={{"gpus": 1}}).spawn("local", Slow)
    print("CALLS", len(remote.nap.call(0.0).get(timeout=30)), end=" ")
    print(len(local.nap.call(0.0).get(timeout=30)))
    for _ in range(3):  # calls still queued when the client ends
        remote.nap.call(0.2)
        local.nap.call(0.2)
    print("EXITING", flush=True)
""")


@pytest.mark.timeout(120)
def test_a_clean_stop_logs_no_warning(tmp_path: Path) -> None:
    """A client that stops procs still starting on a tcp agent, then exits with calls queued
    on remote and local procs, ends cleanly: neither it nor the agent logs a warning (a
    `send_failed` to a proc whose port is not known yet, say)."""
    env = {k: v for k, v in os.environ.items() if k != "MESHVISOR_CURVE_KEYS"}
    alloc, rundir = tmp_path / "hosts", tmp_path / "run"
    rundir.mkdir(mode=0o700)
    command = [sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"]
    command += ["--rundir", str(rundir), "--allocation", str(alloc), "--owner-timeout", "1"]
    with open(tmp_path / "agent.err", "w") as agent_err:
        agent = subprocess.Popen(command, env=env, stderr=agent_err)
    try:
        wait_until(alloc.exists, T, "the agent to join the allocation")
        script = tmp_path / "client.py"
        script.write_text(QUIET_STOP_CLIENT.format(alloc=str(alloc)))
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90
        )
        time.sleep(OWNER_TIMEOUT_S * 2)  # the agent stops what the client left, quietly too
    finally:
        agent.terminate()
        agent.wait(T)
    logged = (tmp_path / "agent.err").read_text()
    assert done.stdout.split() == ["CALLS", "2", "1", "EXITING"], done.stdout + done.stderr
    assert "[warning" not in done.stderr and "[error" not in done.stderr, done.stderr
    assert "[warning" not in logged and "[error" not in logged, logged
