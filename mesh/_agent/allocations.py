"""Allocation files: which host agents form a persistent allocation, and where its keys are.

An allocation is a small text file, one agent address per line, kept in
``$MESHVISOR_HOME/allocations/NAME`` (default ``~/.meshvisor``), or any file named by path.
Agents add themselves when they start (``--allocation``) and leave when they stop; clients only
read it (`mesh.attach`). Its CURVE keys, when agents made them, are in the private ``F.keys``
beside the file F. Here, below the user-facing layer, because the agent daemon writes these
files and `attach` reads them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mesh._settings import current_settings


def allocations_dir() -> Path:
    """Where named allocations are kept (created private on first use)."""
    path = current_settings().allocations_home / "allocations"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def allocation_file(name_or_path: str) -> Path:
    """The file of allocation `name_or_path` (a name, or a path to a file)."""
    if os.sep in name_or_path or name_or_path.startswith("."):
        return Path(name_or_path)
    return allocations_dir() / name_or_path


def add_to_allocation(name_or_path: str, address: str) -> None:
    """Record that the agent at `address` belongs to the allocation, dropping the addresses of
    agents that are gone (nothing listens there any more: killed, or their host rebooted)."""
    with _locked(allocation_file(name_or_path)) as path:
        kept = [a for a in _addresses_in(path) if a != address and not agent_gone(a)]
        _write_addresses(path, [*kept, address])


def remove_from_allocation(name_or_path: str, address: str) -> None:
    """The agent at `address` leaves the allocation (it is stopping)."""
    with _locked(allocation_file(name_or_path)) as path:
        kept = [a for a in _addresses_in(path) if a != address]
        _write_addresses(path, kept)


def agent_gone(address: str) -> bool:
    """Whether nothing listens at an agent address any more: its socket file is missing, or the
    connection is refused. An address that does not answer in time may only be cut off: kept."""
    if address.startswith("ipc://") and not os.path.exists(address[len("ipc://") :]):
        return True
    found = _probe_target(address)
    if found is None:
        return False
    family, target = found
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(_PROBE_TIMEOUT_S)
        try:
            probe.connect(target)
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


def _probe_target(address: str) -> tuple[socket.AddressFamily, Any] | None:
    """(family, connect argument) for a plain connection to `address`, None if it has none."""
    if address.startswith("ipc://"):
        return socket.AF_UNIX, address[len("ipc://") :]
    host, _, port = address[len("tcp://") :].rpartition(":")
    if not address.startswith("tcp://") or not port.isdigit():
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return family, (host.strip("[]"), int(port))


_PROBE_TIMEOUT_S = 1.0


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[Path]:
    """Hold the allocation's lock file while its file is rewritten (readers see either the
    old file or the new one: it is replaced atomically)."""
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield path


def _addresses_in(path: Path) -> list[str]:
    try:
        return list(dict.fromkeys(path.read_text().split()))
    except FileNotFoundError:
        return []


def _write_addresses(path: Path, addresses: list[str]) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text("".join(f"{a}\n" for a in addresses))
    os.replace(temporary, path)


def read_allocation(name_or_path: str) -> list[str]:
    """The agent addresses recorded in allocation `name_or_path`, in the order they joined."""
    path = allocation_file(name_or_path)
    try:
        lines = path.read_text().split()
    except FileNotFoundError:
        raise ValueError(
            f"no allocation {name_or_path!r}: {path} does not exist; start agents with "
            f"'meshvisor agent --allocation {name_or_path}' first"
        ) from None
    return list(dict.fromkeys(line for line in lines if line))


def allocation_keys_dir(name_or_path: str) -> Path:
    """Where the CURVE keys made for allocation `name_or_path` are kept: ``F.keys`` beside its
    file F."""
    path = allocation_file(name_or_path)
    return path.with_name(path.name + ".keys")
