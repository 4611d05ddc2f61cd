"""Bring your own launcher: `run_worker_loop_forever` on each host, `attach_to_workers` in the
client (``monarch.actor``'s names; `run_worker_loop_until_shutdown` returns instead of exiting).

Any launcher (ssh, a container orchestrator, mpirun, a SLURM step) starts a Python program on
each host that calls ``run_worker_loop_forever(address="tcp://HOST:PORT")``: the program becomes
that host's agent. The client then calls ``attach_to_workers(workers=[...])`` with those
addresses and gets a `HostMesh` of them. Every tcp link is authenticated with CURVE keys, as for
``meshvisor agent``: workers and client need the same key pair (``meshvisor keys DIR``, then
``keys=DIR`` or ``MESHVISOR_CURVE_KEYS=DIR`` on both sides).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NoReturn

from mesh._api.attach import attach
from mesh._api.host_mesh import HostMesh
from mesh._engine.future import Future
from transport import KEYS_ENV, check_exposure, configured_keys, use_curve_keys

#: The one `ca` value Monarch scripts pass that meshvisor can honour (it authenticates anyway).
TRUST_ALL = "trust_all_connections"

#: How long `attach_to_workers` waits for a worker address given as a future.
WORKER_ADDRESS_TIMEOUT_S = 600.0


def run_worker_loop_forever(
    *,
    address: str,
    ca: str | None = None,
    private_key: object = None,
    keys: str | os.PathLike[str] | None = None,
    allocation: str | None = None,
) -> NoReturn:
    """Make this process a host agent listening at `address` (``tcp://HOST:PORT`` or
    ``ipc://PATH``) and serve until the host mesh is shut down, then exit with status 0.

    `keys` names the CURVE key directory (default: ``MESHVISOR_CURVE_KEYS``); `allocation`
    also adds the worker to a named allocation, which makes keys for it if there are none.
    Call it before this process starts threads: the agent forks its fork server first.
    `ca` and `private_key` exist for Monarch scripts: meshvisor uses CURVE keys, not TLS.
    """
    _check_monarch_security(ca, private_key)
    if not address.startswith(("tcp://", "ipc://")):
        raise ValueError(f"worker address {address!r} must be tcp://HOST:PORT or ipc://PATH")
    if keys is not None:
        use_curve_keys(os.path.abspath(keys))
    if address.startswith("tcp://") and allocation is None and configured_keys() is None:
        check_exposure(address[len("tcp://") :].rsplit(":", 1)[0])  # raises, saying what to do
    from mesh._agent.daemon import main as run_agent  # the agent's imports, only for a worker

    argv = ["--listen", address, *(["--allocation", allocation] if allocation else [])]
    run_agent(argv, prog="run_worker_loop_forever")
    raise SystemExit(0)  # run_agent exits; for the type checker


def run_worker_loop_until_shutdown(
    *,
    address: str,
    ca: str | None = None,
    private_key: object = None,
    keys: str | os.PathLike[str] | None = None,
    allocation: str | None = None,
) -> None:
    """`run_worker_loop_forever`, but return once the host mesh shuts this worker down (the
    program goes on) instead of exiting."""
    try:
        run_worker_loop_forever(
            address=address, ca=ca, private_key=private_key, keys=keys, allocation=allocation
        )
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise


def attach_to_workers(
    *,
    workers: Sequence[str | Future[str]],
    ca: str | None = None,
    private_key: object = None,
    name: str | None = None,
    listen_host: str = "127.0.0.1",
) -> HostMesh:
    """A `HostMesh` with extent ``{"hosts": N}`` over workers started with
    `run_worker_loop_forever`, in the order given (addresses, or futures of addresses).

    The client authenticates with ``MESHVISOR_CURVE_KEYS`` (the workers' keys) and listens at
    `listen_host` for the procs to reach it. `ca` and `private_key` exist for Monarch scripts
    (meshvisor uses CURVE keys, not TLS); `name` too: meshvisor's host meshes are known by
    their hosts' addresses.
    """
    _check_monarch_security(ca, private_key)
    if isinstance(workers, str):
        raise TypeError("attach_to_workers(workers=...) takes a list of addresses, not one string")
    if not workers:
        raise ValueError("attach_to_workers() needs at least one worker address")
    addresses = [_address_of(worker) for worker in workers]
    if any(address.startswith("tcp://") for address in addresses) and configured_keys() is None:
        raise ValueError(
            f"cannot attach to tcp workers without their CURVE keys: set {KEYS_ENV}=DIR to the "
            f"key directory the workers got (keys=DIR or their own {KEYS_ENV})"
        )
    return attach(addresses, listen_host=listen_host)


def _address_of(worker: str | Future[str]) -> str:
    address = worker.get(timeout=WORKER_ADDRESS_TIMEOUT_S) if isinstance(worker, Future) else worker
    if not isinstance(address, str):
        raise TypeError(f"a worker address must be a string like tcp://HOST:PORT, not {address!r}")
    return address


def _check_monarch_security(ca: str | None, private_key: object) -> None:
    if ca not in (None, TRUST_ALL) or private_key is not None:
        raise ValueError(
            "meshvisor authenticates workers with CURVE keys, not TLS certificates: leave out "
            f"ca/private_key (or pass ca={TRUST_ALL!r}) and give workers and client the same "
            f"key directory ('meshvisor keys DIR', then keys=DIR or {KEYS_ENV}=DIR)"
        )
