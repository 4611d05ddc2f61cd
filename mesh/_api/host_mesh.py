"""`HostMesh`: hosts, each served by a host agent; spawns procs on them."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Literal

from mesh._api.bootstrap import BootstrapCommand, pickled_bootstrap
from mesh._api.mesh_base import DEFAULT_STOP_GRACE_S, MeshBase, check_name, file_safe
from mesh._api.proc_mesh import ProcMesh
from mesh._context import context
from mesh._engine.future import Future, resolved
from mesh._engine.messages import ShutdownAgent
from mesh._engine.ownership import ProcMeshRecord
from mesh._engine.peers import ProcPeer
from mesh._engine.proc_faults import parse_memory_limit
from mesh._engine.runtime import Runtime
from mesh._engine.session import current_session
from mesh._shape import Extent, Region
from supervision import RestartPolicy
from transport import check_fd_headroom

#: File descriptors one proc costs the process that owns and calls it (connections both
#: ways, more while it starts), an upper bound measured on Linux.
FDS_PER_PROC = 9
#: How long `HostMesh.initialized` waits for host agents that a launcher is still starting.
INITIALIZE_TIMEOUT_S = 600.0


class HostMesh(MeshBase):
    """Hosts, each served by a host agent; spawns procs on them."""

    def __init__(
        self, agents: tuple[str, ...], region: Region, bootstrap: BootstrapCommand | None = None
    ) -> None:
        self._agents = agents
        self._region = region
        self._bootstrap = bootstrap

    def _with_region(self, region: Region) -> HostMesh:
        return HostMesh(self._agents, region, self._bootstrap)

    def with_python_executable(self, executable: str) -> HostMesh:
        """These hosts, spawning procs with the Python interpreter `executable` (another
        virtualenv, say) instead of forking them: `BootstrapCommand.python(executable)`."""
        return HostMesh(self._agents, self._region, BootstrapCommand.python(executable))

    def spawn_procs(
        self,
        per_host: Mapping[str, int] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        name: str = "procs",
        heartbeat_interval_s: float | None = None,
        heartbeat_timeout_s: float | None = None,
        busy_timeout_s: float | None = None,
        restart: RestartPolicy | None = None,
        spare_hosts: HostMesh | None = None,
        bootstrap_command: BootstrapCommand | None = None,
        bootstrap: Callable[[], object] | None = None,
        memory_limit: int | str | None = None,
    ) -> ProcMesh:
        """One new OS process per point of each host times ``per_host``; returns at once.

        A proc that sends no heartbeat for `heartbeat_timeout_s` and makes no progress
        (stopped, or blocked) is killed and reported as hung; one that keeps using CPU time
        meanwhile (a long C call holding the GIL, an overloaded machine) gets up to
        `busy_timeout_s`. With a `restart` policy, failed ranks are re-spawned on their agents
        (with their actors) instead of escalating, within its limits; the ranks of a host that
        is lost (its agent died or went silent) are re-spawned on a host of `spare_hosts` not
        taken yet (one spare per lost host), and escalate when none is left. Procs are forked
        from the agent's fork server, unless a `bootstrap_command` (or this mesh's
        `with_python_executable`) starts each with a command; a command that cannot start
        fails its ranks with a `SupervisionError` naming it. A `bootstrap` function (sync or
        async, no arguments) runs in each proc before it is ready, and again in a re-spawned
        one; one that raises fails its rank (``"spawn_failed"``, with its traceback). A
        `memory_limit` (bytes, or a size such as ``"2GiB"``) caps each proc's private memory:
        a proc that exceeds it fails as ``"oom"`` (see docs/failure-evidence.md).
        """
        setup = pickled_bootstrap(bootstrap)
        memory_bytes = parse_memory_limit(memory_limit)
        command = bootstrap_command or self._bootstrap
        if command is not None and not isinstance(command, BootstrapCommand):
            raise TypeError(f"bootstrap_command must be a BootstrapCommand, not {command!r}")
        if spare_hosts is not None and restart is None:
            raise ValueError(
                "spare_hosts is used by a restart policy: pass restart=RestartPolicy(...) too, "
                "or re-spawn on a spare by hand with ProcMesh.respawn(on=spare_hosts)"
            )
        interval, timeout, busy = current_session().runtime.settings.heartbeats(
            heartbeat_interval_s, heartbeat_timeout_s, busy_timeout_s
        )
        check_name("proc mesh", name)
        per_host = dict(per_host or {})
        overlap = set(per_host) & set(self.extent.labels)
        if overlap:
            raise ValueError(
                f"per_host dimensions {sorted(overlap)} clash with the host mesh's "
                f"dimensions {list(self.extent.labels)}"
            )
        extent = Extent(
            self.extent.labels + tuple(per_host), self.extent.sizes + tuple(per_host.values())
        )
        if env is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise TypeError("env must map str to str")
        for key, value in (env or {}).items():
            if not key or "=" in key or "\0" in key or "\0" in value:
                raise ValueError(
                    f"env variable {key[:40]!r} cannot be set: names must be non-empty without "
                    "'=' or NUL, and values without NUL"
                )
        runtime = current_session().runtime
        _check_fds_for_procs(runtime, extent.nelements)
        key = f"{file_safe(name)}-{secrets.token_hex(3)}"
        owner_actor = context().actor_id
        peers = tuple(
            runtime.ownership.add_peer(
                ProcPeer(
                    f"{key}-{rank}",
                    name,
                    point,
                    self._agents[self._region.ranks[rank // (extent.nelements // len(self))]],
                    mesh_key=key,
                    owned=True,
                    owner_actor=owner_actor,
                )
            )
            for rank, point in enumerate(extent.points())
        )
        record = ProcMeshRecord(
            key, name, extent, peers, _proc_env(env, command), interval, timeout, busy
        )
        record.bootstrap = command.argv() if command is not None else ()
        record.setup = setup
        record.memory_limit = memory_bytes
        if spare_hosts is not None:
            record.spares = tuple(spare_hosts._agents_in_order())
        runtime.ownership.add_proc_mesh(record, restart)
        runtime.restarts.launch(record, list(range(len(peers))))
        return ProcMesh(runtime, name, Region.full(extent), peers)

    def _agents_in_order(self) -> list[str]:
        """The host agents of this (sliced) mesh, each once, in the order of its points."""
        return list(dict.fromkeys(self._agents[base] for base in self._region.ranks))

    def _agent_addresses(self) -> list[str]:
        """The address of each host agent of this (sliced) mesh."""
        return sorted({self._agents[base] for base in self._region.ranks})

    def wait_for_agents(self, timeout_s: float = 30.0) -> None:
        """Block until every host agent of this mesh has answered this process; TimeoutError
        naming those that did not within `timeout_s`."""
        agents = self._agent_addresses()
        watch = current_session().runtime.agents
        watch.keep_alive(agents)
        deadline = time.monotonic() + timeout_s
        while True:
            silent = [agent for agent in agents if not watch.answered(agent)]
            if not silent:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"host agents {silent} did not answer within {timeout_s:g} s: they are not "
                    "running, not reachable from here, or use other CURVE keys"
                )
            time.sleep(0.01)

    @property
    def initialized(self) -> Future[Literal[True]]:
        """Done with True once every host agent of this mesh has answered (Monarch's
        ``await host_mesh.initialized``); TimeoutError after `INITIALIZE_TIMEOUT_S`."""
        future: Future[Literal[True]] = Future(description="the host mesh's initialization")

        def wait() -> None:
            try:
                self.wait_for_agents(INITIALIZE_TIMEOUT_S)
            except BaseException as error:
                future.set_exception(error)
            else:
                future.set_result(True)

        threading.Thread(target=wait, name="host-mesh-initialized", daemon=True).start()
        return future

    def shutdown(self) -> Future[None]:
        """Stop the host agents of this mesh, and with them every proc they run (for an
        attached allocation: the daemons themselves)."""
        session = current_session()
        agents = {self._agents[base] for base in self._region.ranks}
        if session.is_client and session.local_agent in agents:
            session.shutdown_local_agent()
        for agent in agents - {session.local_agent}:
            session.runtime.agents.agent_stopping(agent)
            session.runtime.send_message(agent, ShutdownAgent(DEFAULT_STOP_GRACE_S))
        return resolved(None)

    def __repr__(self) -> str:
        return f"<HostMesh {self.sizes}>"


def _proc_env(
    env: Mapping[str, str] | None, bootstrap: BootstrapCommand | None
) -> tuple[tuple[str, str], ...]:
    """The environment the procs get on top of their agent's: `env`, and a bootstrap
    command's own."""
    return tuple({**(env or {}), **(bootstrap.env if bootstrap else {})}.items())


def _check_fds_for_procs(runtime: Runtime, count: int) -> None:
    """Refuse to spawn `count` procs when their connections would exhaust this process's file
    descriptors (libzmq would abort it), counting the procs still starting too."""
    starting = sum(1 for peer in runtime.ownership.all_peers() if peer.state == "starting")
    check_fd_headroom((count + starting) * FDS_PER_PROC, f"spawning {count} procs")


def this_host() -> HostMesh:
    """The host this code runs on; in the client, a local agent is started on first use."""
    agent = current_session().agent_address()
    return HostMesh((agent,), Region.full(Extent((), ())))
