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
