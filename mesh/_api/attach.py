"""Allocations: host agents that run on their own (``meshvisor agent``), attached to by name.

An allocation is a small text file, one agent address per line, kept in
``$MESHVISOR_HOME/allocations/NAME`` (default ``~/.meshvisor``). ``meshvisor agent
--allocation NAME`` adds the agent to it; ``attach("NAME")`` (or a list of addresses, or a path)
gives a `HostMesh` over those agents with extent ``{"hosts": N}``. The agents outlive clients: a
client that exits or dies has its procs stopped, and the next client attaches again.

An agent leaves the file when it stops; the addresses of agents that died without doing so
(SIGKILL, a lost host) are dropped when the next agent joins, if nothing listens there any more.
Clients only read the file: a dead agent they attach to is reported as unreachable.

tcp agents are always authenticated. Agents started without keys make a CURVE key pair for
their allocation file F in the private directory ``F.keys``; ``attach`` finds it there unless
``MESHVISOR_CURVE_KEYS`` names the keys to use.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mesh._api.meshes import HostMesh
from mesh._engine.session import current_session
from mesh._shape import Extent, Region
from transport import KEYS_ENV


def allocations_dir() -> Path:
    """Where named allocations are kept (created private on first use)."""
    home = Path(os.environ.get("MESHVISOR_HOME", Path.home() / ".meshvisor"))
    path = home / "allocations"
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


#: The keys directory attach() chose for this process (None: none, or the user's own choice).
_chosen_keys: str | None = None


def use_allocation_keys(agents: str | Sequence[str]) -> None:
    """Make this process authenticate with the keys of the allocation it attaches to over tcp:
    those named by MESHVISOR_CURVE_KEYS if the user set it, else those made for the allocation."""
    global _chosen_keys
    current = os.environ.get(KEYS_ENV)
    if current and current != _chosen_keys:
        return  # the user's choice
    own = allocation_keys_dir(agents) if isinstance(agents, str) else None
    if own is not None and (own / "allocation.key_secret").exists():
        if current and current != str(own):
            raise ValueError(
                f"cannot attach to {agents!r} with its keys in {own}: this client already "
                f"uses those of another allocation ({current}), and one process uses one key "
                f"pair; make shared keys with 'meshvisor keys DIR' and start both "
                f"allocations' agents with --keys DIR"
            )
        os.environ[KEYS_ENV] = _chosen_keys = str(own)
    elif not current:
        where = f" (none were made in {own})" if own is not None else ""
        raise ValueError(
            f"cannot attach to tcp agents {agents!r} without their allocation's CURVE "
            f"keys{where}: set {KEYS_ENV}=DIR to the directory the agents got with --keys "
            "DIR, or attach by allocation name or file so that the keys made for it are found"
        )


def attach(agents: str | Sequence[str], *, listen_host: str = "127.0.0.1") -> HostMesh:
    """A `HostMesh` over running host agents: an allocation name or file, or addresses.

    The client listens on tcp at `listen_host` so that procs on those hosts can reach it
    (loopback by default: pass the address of this machine's interface for other hosts).
    Connections to tcp agents are authenticated with the allocation's CURVE keys (see
    `use_allocation_keys`).
    """
    addresses = read_allocation(agents) if isinstance(agents, str) else list(agents)
    if not addresses:
        raise ValueError("attach() needs at least one host agent address")
    for address in addresses:
        if not address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{address!r} is not an agent address (tcp://HOST:PORT or ipc://)")
    if any(address.startswith("tcp://") for address in addresses):
        use_allocation_keys(agents)
    runtime = current_session().runtime
    if any(address.startswith("tcp://") for address in addresses):
        runtime.listen_on_tcp(listen_host)
    runtime.agents.keep_alive(addresses)
    return HostMesh(tuple(addresses), Region.full(Extent(("hosts",), (len(addresses),))))
