"""`HostMesh`: hosts, each served by a host agent; spawns procs on them."""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from mesh._api.actor_mesh import ActorMesh
from mesh._api.bootstrap import BootstrapCommand, pickled_bootstrap
from mesh._api.detached import (
    DetachedMeshInfo,
    adopt,
    list_detached,
    register_detached,
    stop_detached,
)
from mesh._api.mesh_base import DEFAULT_STOP_GRACE_S, MeshBase, check_name, file_safe
from mesh._api.proc_mesh import ProcMesh
from mesh._api.workspace import ProgressCallback, WorkspaceSync, sync_files
from mesh._api.workspace_reload import Reload, apply_reload, check_reload
from mesh._context import context
from mesh._engine.future import Future, resolved
from mesh._engine.messages import ShutdownAgent
from mesh._engine.notebook import in_notebook
from mesh._engine.ownership import FailureHandler, ProcMeshRecord
from mesh._engine.peers import ProcPeer
from mesh._engine.proc_faults import parse_memory_limit
from mesh._engine.runtime import Runtime
from mesh._engine.session import current_session
from mesh._engine.workspace_files import WorkspaceError, name_problem
from mesh._shape import Extent, Region
from supervision import RestartPolicy
from transport import KEYS_ENV, check_fd_headroom

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
        detached: bool = False,
        ttl_s: float | None = None,
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
        ``detached=True`` (on a persistent allocation) keeps the procs and their actors when
        this process goes away, under `name`, for another client to adopt (`adopt_procs`);
        ``ttl_s`` stops them after that long without an owner (see docs/detached-meshes.md).
        """
        setup = pickled_bootstrap(bootstrap)
        memory_bytes = parse_memory_limit(memory_limit)
        detached_ttl_s = self._check_detachable(ttl_s) if detached else 0.0
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
        if KEYS_ENV in (env or {}) or (command is not None and KEYS_ENV in command.env):
            raise ValueError(
                f"env cannot set {KEYS_ENV}: procs authenticate with their host agent's CURVE "
                "keys (with others, neither their agent nor their owner could reach them, and "
                f"their spawn and calls would wait forever); give the keys to the agents "
                f"(--keys DIR) and to this process ({KEYS_ENV}=DIR) instead"
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
        record.forward_output = in_notebook()  # a kernel's own output is not the notebook
        if spare_hosts is not None:
            record.spares = tuple(spare_hosts._agents_in_order())
        if detached:
            record.detached = name
            try:
                register_detached(runtime, record, restart, detached_ttl_s)
            except BaseException:
                runtime.ownership.drop_peers(peers)
                raise
        runtime.ownership.add_proc_mesh(record, restart)
        runtime.restarts.launch(record, list(range(len(peers))))
        return ProcMesh(runtime, name, Region.full(extent), peers)

    def _check_detachable(self, ttl_s: float | None) -> float:
        """`ttl_s` as agents take it (0: no limit), if these hosts can keep detached meshes:
        not the agent this client started (`this_host()`), which ends with it."""
        checked = _check_ttl(ttl_s)
        if current_session().local_agent in self._agents_in_order():
            raise ValueError(
                "this_host()'s agent ends with this client, so it cannot keep a detached mesh: "
                "detach meshes on agents started with 'meshvisor agent' or by a job (a "
                "persistent allocation), attached with attach()"
            )
        return checked

    def adopt_procs(self, name: str, *, on_failure: FailureHandler | None = None) -> ProcMesh:
        """Become the owner of the detached proc mesh `name` on these hosts: the same procs
        and actors (`ProcMesh.actor_mesh(name)`), nothing restarted. Failures kept while it
        had no owner follow, to `on_failure` if given (else like any unhandled failure).
        LookupError if there is none, AdoptionError if another live client owns it."""
        runtime = current_session().runtime
        record, _ = adopt(runtime, self._agent_addresses(), name, on_failure)
        return ProcMesh(runtime, name, Region.full(record.extent), record.peers)

    def get_or_spawn_procs(
        self,
        name: str,
        per_host: Mapping[str, int] | None = None,
        *,
        on_failure: FailureHandler | None = None,
        **spawn_options: Any,
    ) -> ProcMesh:
        """The detached proc mesh `name`: adopted if it exists (owned here already: the same
        mesh), else spawned detached (`spawn_procs(..., detached=True)`). Scripts that run
        again and again get the same procs."""
        runtime = current_session().runtime
        owned = [r for r in runtime.ownership.proc_meshes.values() if r.detached == name]
        try:
            procs = (
                ProcMesh(runtime, name, Region.full(owned[0].extent), owned[0].peers)
                if owned
                else self.adopt_procs(name, on_failure=on_failure)
            )
        except LookupError:
            try:
                procs = self.spawn_procs(per_host, name=name, detached=True, **spawn_options)
            except ValueError as error:
                if "exists already" not in str(error):
                    raise
                procs = self.adopt_procs(name, on_failure=on_failure)  # another script won
            else:
                if on_failure is not None:
                    procs.on_failure(on_failure)
        _check_shape(procs, self.extent, per_host)
        return procs

    def detached_meshes(self) -> list[DetachedMeshInfo]:
        """The detached meshes on these hosts: name, procs, owner or since when it has none."""
        return list_detached(current_session().runtime, self._agent_addresses())

    def stop_detached(self, name: str, grace_s: float = DEFAULT_STOP_GRACE_S) -> int:
        """Stop detached mesh `name` on these hosts, whoever owns it; its running procs."""
        return stop_detached(current_session().runtime, self._agent_addresses(), name, grace_s)

    def sync_workspace(
        self,
        local_dir: str | os.PathLike[str],
        remote_name: str | None = None,
        *,
        reload: Reload = False,
        meshes: Sequence[ActorMesh[Any] | ProcMesh] = (),
        progress: bool | ProgressCallback = True,
        timeout_s: float = 30.0,
    ) -> Future[WorkspaceSync]:
        """Copy `local_dir` (your code) to every host of this mesh as workspace `remote_name`
        (default: its folder's name), sending only the files that changed; new procs import
        it (it comes first on their ``sys.path``). ``reload="modules"`` then reloads the
        changed modules in the procs of the actor meshes `meshes`; ``reload="restart"``
        restarts the proc meshes `meshes`. `progress`: a line on stderr for large syncs, or a
        callable given `SyncProgress`. The future's `WorkspaceSync` says what each host
        wrote; WorkspaceError when a path, a symlink or a size is refused or a host agent
        does not answer within `timeout_s`. See docs/workspace-sync.md."""
        folder = os.path.expanduser(os.fspath(local_dir))
        name = remote_name or os.path.basename(os.path.realpath(folder))
        problem = name_problem(name)
        if problem is not None:
            raise WorkspaceError(f"cannot sync {local_dir!r}: {problem}")
        check_reload(reload, meshes)
        runtime, agents = current_session().runtime, self._agent_addresses()
        done: Future[WorkspaceSync] = Future(description=f"the sync of workspace {name!r}")

        def run() -> None:
            try:
                synced = sync_files(runtime, agents, folder, name, progress, timeout_s)
                synced = apply_reload(
                    runtime, synced, reload, meshes, DEFAULT_STOP_GRACE_S, timeout_s
                )
            except BaseException as error:
                done.set_exception(error)
            else:
                done.set_result(synced)

        threading.Thread(target=run, name="meshvisor-workspace-sync", daemon=True).start()
        return done

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
    agent = current_session(with_local_agent=True).agent_address()
    return HostMesh((agent,), Region.full(Extent((), ())))


def _check_ttl(ttl_s: float | None) -> float:
    """`ttl_s` of a detached mesh as agents take it (0: no limit)."""
    if ttl_s is None:
        return 0.0
    if not isinstance(ttl_s, (int, float)) or not 0 < ttl_s < float("inf"):
        raise ValueError(f"ttl_s must be a positive number of seconds or None, not {ttl_s!r}")
    return float(ttl_s)


def _check_shape(procs: ProcMesh, hosts: Extent, per_host: Mapping[str, int] | None) -> None:
    """An adopted mesh must have the shape the caller asked for."""
    wanted = {**dict(zip(hosts.labels, hosts.sizes)), **dict(per_host or {})}
    if per_host is not None and dict(procs.sizes) != wanted:
        raise ValueError(
            f"detached proc mesh {procs.name!r} has sizes {dict(procs.sizes)}, not {wanted}; "
            "stop it first ('meshvisor meshes stop') or use another name"
        )
