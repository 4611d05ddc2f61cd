"""A host agent that stands for another host: its own mount namespace hides the client's ipc
socket files, so its procs reach the client over tcp only, as a proc on another machine does.

What a client hands to a proc there must name an address that proc can use, also when it was
made before the client listened on tcp (a `Port` opened before `attach`). Needs root (a mount
namespace) and `unshare`; skipped with the reason otherwise. Processes and dirs are removed.
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

T = 30.0


@pytest.fixture
def other_host() -> Iterator[tuple[Path, Path]]:
    """(allocation file, the client's runtime base): a tcp agent that cannot see that base
    (a tmpfs over it in the agent's mount namespace). Both are removed afterwards."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a host apart needs root and 'unshare' (a mount namespace)")
    folder = Path(RUN_BASE) / f"oh{time.monotonic_ns() % 10**8}"
    client_base, rundir = folder / "c", folder / "run"
    for path in (folder, client_base, rundir):
        path.mkdir(mode=0o700)
    alloc = folder / "hosts"
    agent = [sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"]
    agent += ["--rundir", str(rundir), "--allocation", str(alloc), "--owner-timeout", "2"]
    hide = f'mount -t tmpfs tmpfs {client_base} && exec "$@"'
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", hide, "sh", *agent]
    with open(folder / "agent.err", "w+") as errors:
        process = subprocess.Popen(command, stderr=errors)
    try:
        wait_until(lambda: alloc.exists() or process.poll() is not None, T, "the agent")
        if process.poll() is not None:
            why = (folder / "agent.err").read_text().strip()
            pytest.skip(f"cannot make a mount namespace here: {why}")
        yield alloc, client_base
    finally:
        process.terminate()
        process.wait(T)
        shutil.rmtree(folder, ignore_errors=True)


def run_client(source: str, client_base: Path, **fields: str) -> subprocess.CompletedProcess[str]:
    """Run `source` (formatted with `fields`) as a client whose ipc sockets are under
    `client_base`, which the other host cannot see."""
    env = os.environ | {"XDG_RUNTIME_DIR": str(client_base), "MESHVISOR_AGENT_TIMEOUT_S": "20"}
    script = textwrap.dedent(source).format(**fields)
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=90
    )


PORT_BEFORE_ATTACH = """
    from mesh import Actor, Channel, attach, endpoint

    class Teller(Actor):
        @endpoint
        def tell(self, port, value) -> None:
            port.send(value)

    port, receiver = Channel.open()  # the client listens on ipc only so far
    procs = attach({alloc!r}).spawn_procs(per_host={{"gpus": 1}})
    procs.spawn("tellers", Teller).tell.call_one(port, 7).get(timeout=20)
    try:
        print("GOT", receiver.recv().get(timeout=20), flush=True)
    except TimeoutError:
        print("NOTHING CAME", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_port_opened_before_attach_reaches_its_receiver_from_another_host(
    other_host: tuple[Path, Path],
) -> None:
    """A port opened while the client listened on ipc only, then sent to a proc on another
    host: it carries the addresses its receiver has when it is sent (tcp by then), so the
    proc's message arrives instead of waiting for an ipc socket that is not on its host."""
    alloc, client_base = other_host
    done = run_client(PORT_BEFORE_ATTACH, client_base, alloc=str(alloc))
    assert "GOT 7" in done.stdout.splitlines(), done.stdout + done.stderr


PORT_PASSED_ON = """
    import time
    from mesh import Actor, Channel, attach, endpoint, this_host

    class Holder(Actor):
        @endpoint
        def keep(self, port) -> None:
            self.port = port

        @endpoint
        def pass_on(self, teller) -> None:  # no answer: this proc is on ipc only
            teller.tell.broadcast(self.port, 7)

    class Teller(Actor):
        told = "NOT TOLD"

        @endpoint
        def tell(self, port, value) -> None:
            try:
                port.send(value)
            except Exception as error:
                self.told = f"REFUSED {{type(error).__name__}}: {{error}}"
            else:
                self.told = "SENT"

        @endpoint
        def outcome(self) -> str:
            return self.told

    port, receiver = Channel.open()  # the client listens on ipc only so far
    holder = this_host().spawn_procs(per_host={{"gpus": 1}}).spawn("holder", Holder)
    holder.keep.call_one(port).get(timeout=20)  # a copy with the ipc address only
    procs = attach({alloc!r}).spawn_procs(per_host={{"gpus": 1}})  # now on tcp too
    tellers = procs.spawn("tellers", Teller)
    holder.pass_on.call_one(tellers).get(timeout=30)
    told, deadline = "NOT TOLD", time.monotonic() + 30
    while told == "NOT TOLD" and time.monotonic() < deadline:  # tell comes from the holder
        told = tellers.outcome.call_one().get(timeout=30)
        time.sleep(0.05)
    print("TOLD", told.replace(chr(10), " "), flush=True)
    if told == "SENT":
        try:
            print("GOT", receiver.recv().get(timeout=20), flush=True)
        except TimeoutError:
            print("NOTHING CAME", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_port_passed_on_from_before_its_receiver_listened_on_tcp_arrives(
    other_host: tuple[Path, Path],
) -> None:
    """A proc on this host got the port while its receiver listened on ipc only, and passes
    it on to a proc on another host: the receiver told its holders its tcp address when it
    began to listen there (`ReceiverAddresses`), so the copy passed on carries it and the
    message arrives (before, that copy's send could only fail)."""
    alloc, client_base = other_host
    done = run_client(PORT_PASSED_ON, client_base, alloc=str(alloc))
    lines = done.stdout.splitlines()
    assert "TOLD SENT" in lines and "GOT 7" in lines, done.stdout + done.stderr


CALL_FROM_A_PROC_ON_IPC = """
    from mesh import Actor, attach, endpoint, this_host

    class Teller(Actor):
        @endpoint
        def value(self, add: int) -> int:
            return 7 + add

    class Caller(Actor):
        @endpoint
        def ask(self, tellers) -> str:
            try:
                one = tellers.slice(gpus=0).value.call_one(0).get(timeout=20)
                return f"GOT {{one}} {{sum(tellers.value.call(1).get(timeout=20).values())}}"
            except TimeoutError:
                return "NO ANSWER"
            except Exception as error:
                return f"FAILED {{type(error).__name__}}: {{error}}"

    caller = this_host().spawn_procs(per_host={{"gpus": 1}}).spawn("caller", Caller)
    tellers = attach({alloc!r}).spawn_procs(per_host={{"gpus": 2}}).spawn("tellers", Teller)
    print(caller.ask.call_one(tellers).get(timeout=60).replace(chr(10), " "), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_proc_that_listens_on_ipc_only_gets_answers_from_another_host(
    other_host: tuple[Path, Path],
) -> None:
    """A proc of this host's agent (on ipc only) calls actors on another host: it listens on
    tcp once it holds their handle, so their answers reach it instead of waiting in zmq for a
    socket file that is not on their host (the call waited for its timeout)."""
    alloc, client_base = other_host
    done = run_client(CALL_FROM_A_PROC_ON_IPC, client_base, alloc=str(alloc))
    assert "GOT 7 16" in done.stdout.splitlines(), done.stdout + done.stderr
