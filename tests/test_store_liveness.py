"""How soon the group store and its clients see each other gone: a call made after the store's
process died ends at once (its attempts to connect are refused), not at its timeout; a client
stopped on the store's own host (ipc) is dropped within the heartbeat timeout, as over tcp."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import pytest
import torch.distributed as dist
from polling import wait_until
from store_processes import WAITER, python, store_process

from recovery.testing import StoreClient, StoreServer
from transport import Addresses

#: Far longer than a call made after the store died may take, far shorter than its timeout.
AT_ONCE_S = 15.0
#: How long a client process may take to start (import torch) on a loaded 2-core machine.
STARTUP_S = 60.0
#: Longer than the heartbeat timeout (1 s here), on a loaded machine; shorter than the wait.
SEEN_GONE_S = 20.0


def _ended_in(call: Callable[[], object]) -> tuple[BaseException | None, float]:
    """The error `call()` raised (None if none), and how long it took."""
    started = time.monotonic()
    try:
        call()
    except Exception as exc:
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_a_call_after_the_store_died_ends_at_once_saying_so(kind: str) -> None:
    with store_process() as (process, addresses):
        store = StoreClient(Addresses.of(str(getattr(addresses, kind))), 60.0)
        try:
            store.set("dead/here", b"1")
            process.kill()
            process.wait()
            error, took = _ended_in(lambda: store.get("dead/here"))  # no request in flight
            assert isinstance(error, dist.DistNetworkError), error  # type: ignore[attr-defined]
            assert "nothing listens" in str(error) and "ended" in str(error), error
            assert took < AT_ONCE_S, f"the call waited {took:.1f} s of its 60 s timeout"
            fresh: list[tuple[BaseException | None, float]] = []  # another thread's connection
            thread = threading.Thread(target=lambda: fresh.append(_ended_in(store.num_keys)))
            thread.start()
            thread.join(90)
            assert isinstance(fresh[0][0], dist.DistNetworkError), fresh  # type: ignore[attr-defined]
            assert fresh[0][1] < AT_ONCE_S, f"a new connection waited {fresh[0][1]:.1f} s"
        finally:
            store.close()


@pytest.mark.timeout(120)
def test_the_waits_of_a_stopped_ipc_client_are_dropped_within_the_heartbeat_timeout() -> None:
    server = StoreServer(name="test-store-ipc", heartbeat_timeout_s=1.0)
    process = python(WAITER, str(server.addresses.ipc))  # on this host: on ipc
    try:
        wait_until(lambda: server.waiting() == 1, STARTUP_S, "the client to wait")
        process.send_signal(signal.SIGSTOP)  # its connection stays open, its wait lasts 120 s
        wait_until(lambda: server.waiting() == 0, SEEN_GONE_S, "its wait to be dropped")
    finally:
        process.kill()
        process.wait()
        server.close()
