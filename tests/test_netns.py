"""A host in its own Linux network namespace: cutting its link makes it unreachable.

The test builds a namespace and a veth pair (10.213.N.1 here, 10.213.N.2 inside), runs a daemon
host agent inside it, and a client outside that attaches to it over that link. Taking the link
down must turn the remote rank into an "unreachable" failure at the client. Needs root and
iproute2; skipped with the reason otherwise. Namespace, link and processes are always removed.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

T = 30.0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def namespace() -> Iterator[tuple[str, str, str, str]]:
    """(namespace, host-side link, host address, namespace address), removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 ('ip')")
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    name, outside, inside = f"mvns{tag}", f"mva{tag}", f"mvb{tag}"
    net = f"10.213.{random.randrange(1, 250)}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as error:
        pytest.skip(f"cannot create a network namespace here: {error.stderr.strip()}")
    try:
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", name)
        _ip("addr", "add", f"{net}.1/30", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{net}.2/30", "dev", inside)
        _ip("netns", "exec", name, "ip", "link", "set", inside, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name, outside, f"{net}.1", f"{net}.2"
    finally:
        subprocess.run(["ip", "link", "del", outside], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


CLIENT = textwrap.dedent("""
    import time
    from mesh import Actor, attach, endpoint
    from supervision import SupervisionError

    class Hello(Actor):
        @endpoint
        def hello(self) -> str:
            return "hello"

    procs = attach([{agent!r}], listen_host={listen!r}).spawn_procs(per_host={{"gpus": 1}})
    print("RESULT", procs.spawn("hello", Hello).hello.call_one().get(timeout=20), flush=True)
    try:
        time.sleep(30)  # the test cuts the link meanwhile
        print("NO FAILURE", flush=True)
    except SupervisionError as error:
        print("FAILURE", error.event.kind, flush=True)
""")


def test_a_cut_link_makes_the_host_unreachable(
    namespace: tuple[str, str, str, str], tmp_path: Path
) -> None:
    name, outside, host_address, ns_address = namespace
    keys = tmp_path / "keys"  # beyond loopback, every connection must be authenticated
    subprocess.run(
        [sys.executable, "-m", "meshvisor", "keys", str(keys)], check=True, capture_output=True
    )
    address_file = tmp_path / "address"
    agent = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            name,
            sys.executable,
            "-m",
            "meshvisor",
            "agent",
            "--listen",
            f"tcp://{ns_address}:0",
            "--address-file",
            str(address_file),
            "--rundir",
            str(tmp_path),
            "--owner-timeout",
            "2",
            "--keys",
            str(keys),
        ]
    )
    client = None
    try:
        deadline = time.monotonic() + T
        while not address_file.exists():
            assert time.monotonic() < deadline, "the agent in the namespace did not start"
            time.sleep(0.02)
        script = tmp_path / "client.py"
        script.write_text(
            CLIENT.format(agent=address_file.read_text().strip(), listen=host_address)
        )
        client = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "MESHVISOR_CURVE_KEYS": str(keys)},
        )
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "RESULT hello"  # across the link
        _ip("link", "set", outside, "down")  # cut it
        cut_at = time.monotonic()
        assert client.stdout.readline().strip() == "FAILURE unreachable"
        assert time.monotonic() - cut_at < 10
        assert client.wait(T) == 0  # and it exits cleanly, removing its run directory
    finally:
        if client is not None:
            if client.poll() is None:
                client.kill()
                client.wait(T)
            client.stdout.close()  # type: ignore[union-attr]
        agent.terminate()
        try:
            agent.wait(T)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(T)


def test_listening_beyond_loopback_needs_keys(tmp_path: Path) -> None:
    """Without CURVE keys an agent refuses a non-loopback address, saying what to do."""
    env = {k: v for k, v in os.environ.items() if k != "MESHVISOR_CURVE_KEYS"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshvisor",
            "agent",
            "--listen",
            "tcp://0.0.0.0:0",
            "--rundir",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=T,
    )
    assert done.returncode == 2
    assert "without authentication" in done.stderr and "meshvisor keys" in done.stderr
