"""A `ReplicaGroup` constructor that raises after it started replicas stops them, and its
store, before the error reaches the caller: nothing it started outlives it."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import replica_actors as ra
from conftest import meshvisor_processes

from mesh import this_host
from recovery import ReplicaGroup
from transport import SerializationError, runtime_base_dir

pytestmark = pytest.mark.timeout(120)


class SlowToBuild(ra.Trainer):
    """Takes long to build: the group's start waits for it (long enough to be interrupted)."""

    def build(self) -> Any:
        time.sleep(60)
        return super().build()


class Interrupted(Exception):
    """Raised by the test's timer signal in the constructor's wait (as a Ctrl-C would be)."""


def stores() -> set[Path]:
    return set(Path(runtime_base_dir()).glob("meshvisor-store-*"))


def eventually(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def started_before() -> Iterator[tuple[set[int], set[Path]]]:
    """The host's processes (its agent and fork server running) and stores before the test."""
    warm = this_host().spawn_procs(per_host={"gpus": 1}, name="warm")
    warm.stop(grace_s=1.0).get(timeout=30)
    yield {pid for pid, _ in meshvisor_processes()}, stores()


def assert_nothing_left(before: tuple[set[int], set[Path]]) -> None:
    pids, store_dirs = before
    assert eventually(lambda: {pid for pid, _ in meshvisor_processes()} <= pids), (
        "the replicas of a group whose constructor raised are still running"
    )
    assert stores() <= store_dirs, "the store of a group whose constructor raised is still open"


def test_an_argument_that_cannot_be_sent_leaves_nothing_running(
    started_before: tuple[set[int], set[Path]],
) -> None:
    with pytest.raises(SerializationError):
        ReplicaGroup(this_host(), ra.Trainer, threading.Lock(), replicas=2)
    assert_nothing_left(started_before)


def test_an_error_while_the_group_starts_stops_every_replica_and_the_store(
    started_before: tuple[set[int], set[Path]],
) -> None:
    def interrupt(signum: int, frame: Any) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 3.0)  # the replicas are spawned, and building
    try:
        with pytest.raises(Interrupted):
            ReplicaGroup(this_host(), SlowToBuild, replicas=3)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert_nothing_left(started_before)
