"""Allocations: host agents that run on their own (``meshvisor agent``), attached to by name.

An allocation is a small text file, one agent address per line, kept in
``$MESHVISOR_HOME/allocations/NAME`` (default ``~/.meshvisor``). ``meshvisor agent
--allocation NAME`` adds the agent to it; ``attach("NAME")`` (or a list of addresses, or a path)
gives a `HostMesh` over those agents with extent ``{"hosts": N}``. The agents outlive clients: a
client that exits or dies has its procs stopped, and the next client attaches again.

An agent leaves the file when it stops; the addresses of agents that died without doing so
(SIGKILL, a lost host) are dropped when the next agent joins, if nothing listens there any more.
Clients only read the file: a dead agent they attach to is reported as unreachable. The files
themselves are read and written by `mesh._agent.allocations`.

tcp agents are always authenticated. Agents started without keys make a CURVE key pair for
their allocation file F in the private directory ``F.keys``; ``attach`` finds it there unless
``MESHVISOR_CURVE_KEYS`` names the keys to use.
"""

from __future__ import annotations

from collections.abc import Sequence

from mesh._agent.allocations import allocation_keys_dir, read_allocation
from mesh._api.host_mesh import HostMesh
from mesh._engine.session import current_session
from mesh._shape import Extent, Region
from transport import KEYS_ENV, point_to_keys, transport_settings, use_curve_keys

#: The keys directory attach() chose for this process (None: none, or the user's own choice).
_chosen_keys: str | None = None


def use_allocation_keys(agents: str | Sequence[str]) -> None:
    """Make this process authenticate with the keys of the allocation it attaches to over tcp:
    those named by MESHVISOR_CURVE_KEYS if the user set it, else those made for the allocation."""
    global _chosen_keys
    current = transport_settings().curve_keys
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
        _chosen_keys = str(own)
        use_curve_keys(_chosen_keys)  # the procs and agents it starts inherit them
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
    session = current_session()
    if any(address.startswith("tcp://") for address in addresses):
        use_allocation_keys(agents)
        # this host's agent and procs, started before, answer the tcp address with these keys
        point_to_keys(session.rundir, transport_settings().curve_keys or "")
        session.runtime.listen_on_tcp(listen_host)
    runtime = session.runtime
    runtime.agents.keep_alive(addresses)
    return HostMesh(tuple(addresses), Region.full(Extent(("hosts",), (len(addresses),))))
