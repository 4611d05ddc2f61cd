"""Allocations: host agents that run on their own (``meshvisor agent``), attached to by name.

An allocation is a small text file, one agent address per line, kept in
``$MESHVISOR_HOME/allocations/NAME`` (default ``~/.meshvisor``). ``meshvisor agent
--allocation NAME`` adds the agent to it; ``attach("NAME")`` (or a list of addresses, or a path)
gives a `HostMesh` over those agents with extent ``{"hosts": N}``. The agents outlive clients: a
client that exits or dies has its procs stopped, and the next client attaches again.

tcp agents are always authenticated. Agents started without keys make a CURVE key pair for
their allocation file F in the private directory ``F.keys``; ``attach`` finds it there unless
``MESHVISOR_CURVE_KEYS`` names the keys to use.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence
from pathlib import Path

from transport import KEYS_ENV

from ._meshes import HostMesh
from ._session import current_session
from ._shape import Extent, Region


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
    """Record that the agent at `address` belongs to the allocation."""
    path = allocation_file(name_or_path)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write(address + "\n")


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
    runtime.keep_alive(addresses)
    return HostMesh(tuple(addresses), Region.full(Extent(("hosts",), (len(addresses),))))
