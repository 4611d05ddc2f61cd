"""The group store and the lifetimes of its clients: the waits of a client whose process died
are dropped at once (not at their timeout, holding a place among the store's waiting
requests meanwhile), and a client closed by another thread than the one calling it stays safe.
Over tcp, a peer that is stopped (SIGSTOP: its connection stays open, like that of a host that
vanished) is seen as gone within the store's heartbeat timeout, on either side; a client back
from such a pause, or whose store is back, connects again and its request in flight is
answered, a write applied once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist
from store_processes import WAITER, python, store_process

from recovery.testing import StoreClient, StoreServer
from transport import Addresses

#: How long a client process may take to start (import torch) on a loaded 2-core machine.
STARTUP_S = 60.0
#: Longer than the heartbeat timeout (2 s, the settings' default), on a loaded machine; far
#: shorter than the waits.
SEEN_GONE_S = 20.0


@pytest.fixture
def server() -> Iterator[StoreServer]:
    store = StoreServer(name="test-store-clients")
    yield store
    store.close()


def eventually(condition: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.timeout(120)
def test_the_waits_of_a_killed_client_are_dropped_at_once(server: StoreServer) -> None:
    live = StoreClient(server.addresses, 30.0)
    answered: list[bytes] = []
    keeper = threading.Thread(target=lambda: answered.append(live.get("dead/later")))
    keeper.start()
    assert server.addresses.ipc is not None
    process = python(WAITER, server.addresses.ipc)
    try:
        assert eventually(lambda: server.waiting() == 2, STARTUP_S), "the client never waited"
        process.send_signal(signal.SIGKILL)
        process.wait()
        # its wait of 120 s is dropped now; the live client's goes on
        assert eventually(lambda: server.waiting() == 1), "a dead client's wait stayed queued"
        live.set("dead/later", b"here")
        keeper.join(10.0)
        assert answered == [b"here"]
        assert server.waiting() == 0
    finally:
        process.kill()
        process.wait()
        if keeper.is_alive():  # (a failed check above): its key comes, its wait ends
            StoreClient(server.addresses, 5.0).set("dead/later", b"here")
        keeper.join(10.0)
        live.close()


@pytest.mark.timeout(60)
def test_closing_a_client_while_another_thread_waits_in_it_is_safe(server: StoreServer) -> None:
    store = StoreClient(server.addresses, 1.0)
    store.set("close/here", b"1")
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            store.get("close/never")
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert eventually(lambda: server.waiting() == 1)
    store.close()  # from this thread, while the waiter's socket is in use
    waiter.join(10.0)
    assert not waiter.is_alive()
    # its call ended as it would have (its timeout), not in an error of a socket closed under it
    assert len(errors) == 1 and isinstance(errors[0], dist.DistStoreError), errors  # type: ignore[attr-defined]
    assert "timeout" in str(errors[0])
    with pytest.raises(dist.DistNetworkError, match="is closed"):  # type: ignore[attr-defined]
        store.get("close/here")
    with pytest.raises(dist.DistNetworkError, match="is closed"):  # type: ignore[attr-defined]
        threading_result(lambda: store.get("close/here"))


def threading_result(call: Callable[[], object]) -> object:
    """`call()` run on a new thread: its result, or its error raised here."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10.0)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


@pytest.mark.timeout(120)
def test_the_waits_of_a_stopped_tcp_client_are_dropped_within_the_heartbeat_timeout(
    server: StoreServer,
) -> None:
    assert server.addresses.tcp is not None, "the suite has keys: the store listens on tcp"
    process = python(WAITER, server.addresses.tcp)
    try:
        assert eventually(lambda: server.waiting() == 1, STARTUP_S), "the client never waited"
        process.send_signal(signal.SIGSTOP)  # its connection stays open, its wait lasts 120 s
        assert eventually(lambda: server.waiting() == 0, SEEN_GONE_S), "its wait stayed queued"
    finally:
        process.kill()
        process.wait()


@pytest.mark.timeout(120)
def test_a_wait_on_a_store_stopped_for_good_ends_at_its_timeout_saying_why() -> None:
    """The client takes the silent connection for closed at the heartbeat timeout and tries
    to connect again until the request's timeout: then it gives up, saying what happened."""
    with store_process() as (process, addresses):
        store = StoreClient(Addresses.of(str(addresses.tcp)), 5.0)
        store.set("stopped/here", b"1")
        threading.Timer(0.5, os.kill, (process.pid, signal.SIGSTOP)).start()
        started = time.monotonic()
        with pytest.raises(dist.DistNetworkError, match="heartbeats"):  # type: ignore[attr-defined]
            store.get("stopped/never")
        assert time.monotonic() - started < SEEN_GONE_S, "the wait outlasted its timeout"
        store.close()


@pytest.mark.timeout(120)
def test_a_write_in_flight_while_the_store_is_stopped_is_applied_once() -> None:
    """An ADD sent to a stopped store: its connection is closed at the heartbeat timeout (1 s)
    with the request unanswered; once the store goes on (3 s), it applies the ADD that came
    down the old connection, and answers the same request sent again down the new one from
    memory: the key holds the amount once, and the caller has its answer."""
    with store_process(heartbeat_timeout_s=1.0) as (process, addresses):
        store = StoreClient(Addresses.of(str(addresses.tcp)), 30.0)
        store.set("paused/ready", b"1")
        os.kill(process.pid, signal.SIGSTOP)
        threading.Timer(3.0, os.kill, (process.pid, signal.SIGCONT)).start()
        assert store.add("paused/count", 5) == 5
        assert store.get("paused/count") == b"5"
        assert store.add("paused/count", 1) == 6  # and the connection serves on
        store.close()


PAUSED_CLIENT = """
import sys
from transport import Addresses
from recovery.testing import StoreClient
store = StoreClient(Addresses.of(sys.argv[1]), 120.0)
print("GOT", store.get("paused/key").decode(), store.add("paused/count", 1), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_client_stopped_past_the_heartbeat_timeout_gets_its_answer_after_all() -> None:
    """A client stopped in a wait: the store drops its connection and its wait; continued,
    the client connects again, re-authenticated, and sends its wait again, answered since."""
    server = StoreServer(name="test-store-paused", heartbeat_timeout_s=1.0)
    assert server.addresses.tcp is not None, "the suite has keys: the store listens on tcp"
    process = python(PAUSED_CLIENT, server.addresses.tcp, stdout=subprocess.PIPE)
    try:
        assert eventually(lambda: server.waiting() == 1, STARTUP_S), "the client never waited"
        process.send_signal(signal.SIGSTOP)
        assert eventually(lambda: server.waiting() == 0, SEEN_GONE_S), "its wait stayed queued"
        StoreClient(server.addresses, 5.0).set("paused/key", b"here")
        process.send_signal(signal.SIGCONT)
        out, _ = process.communicate(timeout=SEEN_GONE_S)
        assert out.split() == ["GOT", "here", "1"], out
    finally:
        process.kill()
        process.wait()
        if process.stdout:
            process.stdout.close()
        server.close()
