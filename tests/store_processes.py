"""A replica group's store, or a client of it, in a process of its own: to kill or stop it."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transport import Addresses

ROOT = Path(__file__).resolve().parents[1]

#: A client that waits 120 s for a key that never comes, at the address argv[1] (ipc or tcp).
WAITER = """
import sys
from transport import Addresses
from recovery.testing import StoreClient
store = StoreClient(Addresses.of(sys.argv[1]), 120.0)
store.get("never/comes")
"""

_SERVER = """
import ast, sys, time
from recovery.testing import StoreServer
server = StoreServer(heartbeat_timeout_s=ast.literal_eval(sys.argv[1]))
print(server.addresses.ipc, server.addresses.tcp, flush=True)
time.sleep(600)
"""


def python(script: str, *args: str, **popen: Any) -> subprocess.Popen[str]:
    """`script` run by a new Python process that imports this checkout's packages."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", script, *args], env=env, text=True, **popen)


@contextlib.contextmanager
def store_process(heartbeat_timeout_s: float | None = None) -> Iterator[tuple[Any, Addresses]]:
    """A store served by a process of its own: (the process, the store's addresses: ipc and
    tcp, the suite having keys)."""
    process = python(_SERVER, repr(heartbeat_timeout_s), stdout=subprocess.PIPE)
    ipc = ""
    try:
        ipc, tcp = (process.stdout.readline() if process.stdout else "").split()
        yield process, Addresses(ipc, tcp)
    finally:
        process.kill()
        process.wait()
        if process.stdout:
            process.stdout.close()
        if ipc:  # (a killed store cannot remove its directory)
            shutil.rmtree(os.path.dirname(ipc[len("ipc://") :]), ignore_errors=True)
