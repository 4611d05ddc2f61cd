"""Actors for tests/test_exchange.py (importable by procs: they unpickle these classes)."""

from __future__ import annotations

import atexit
import datetime
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from replica_actors import Trainer

from mesh import Actor, concurrent_endpoint, current_rank, endpoint
from mesh.testing import signal_this_process
from recovery import exchange_average
from recovery.testing import StoreClient, open_group, wait_unless_aborted
from transport import Addresses


def gradient(seed: int, rank: int, numel: int) -> torch.Tensor:
    """A deterministic gradient of `rank`, with magnitudes spread wide so that the order of a
    sum changes its bits."""
    generator = torch.Generator().manual_seed(seed * 1009 + rank)
    scale = torch.exp(torch.randn(numel, generator=generator) * 8)
    return torch.randn(numel, generator=generator) * scale


class Exchanger(Actor):
    """Joins a gloo group of the first `world` ranks and averages `gradient`s through it."""

    @endpoint
    def average(
        self, store: Addresses, tag: str, world: int, seed: int, numel: int
    ) -> torch.Tensor:
        torch.set_num_threads(1)
        rank = current_rank().rank
        timeout = datetime.timedelta(seconds=60)
        client = StoreClient(store, 60.0)
        prefixed = dist.PrefixStore(tag, client)  # type: ignore[attr-defined]
        group = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        local = gradient(seed, rank, numel)
        averaged = exchange_average(group, local, lambda: None)
        again = exchange_average(group, local, lambda: None, out=averaged)  # reused memory
        if again.data_ptr() != averaged.data_ptr():
            raise RuntimeError("the exchange did not write its result into `out`")
        return again.clone()


class StallingTrainer(Trainer):
    """Sends itself `signal` at chosen (step, phase) points, once each (a marker file in
    `marks` remembers it): SIGKILL dies, SIGSTOP hangs."""

    def __init__(self, plan: dict[int, list[tuple[int, str, str]]], marks: str) -> None:
        super().__init__()
        self.plan = plan
        self.marks = Path(marks)

    def on_phase(self, phase: str, step: int) -> None:
        for when, where, signame in self.plan.get(self.replica_id, []):
            if (when, where) != (step, phase):
                continue
            try:
                (self.marks / f"{self.replica_id}-{step}-{phase}").touch(exist_ok=False)
            except FileExistsError:
                return
            signal_this_process(getattr(signal, signame))


class LateToExchange(StallingTrainer):
    """`StallingTrainer` whose replica `late` enters the exchange of step `at` only once the
    file `go` of `marks` exists (at most 30 s); it then notes in `saw` of `marks` what its
    abort watch says about the process group it is in (`none` if nothing)."""

    def __init__(
        self, plan: dict[int, list[tuple[int, str, str]]], marks: str, late: int, at: int
    ) -> None:
        super().__init__(plan, marks)
        self.late, self.at = late, at

    def on_phase(self, phase: str, step: int) -> None:
        late = (self.replica_id, step, phase) == (self.late, self.at, "allreduce")
        if late and not (self.marks / "saw").exists():
            deadline = time.monotonic() + 30.0
            while not (self.marks / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert self._aborts is not None  # in a group since its join
            (self.marks / "saw").write_text(self._aborts() or "none")
        super().on_phase(phase, step)


class HangsWhileBuilt(Trainer):
    """The first replica built (per `marks` directory) stops its own process (SIGSTOP) in
    build(), so the group finds it hung while it starts."""

    def __init__(self, marks: str) -> None:
        self.marks = Path(marks)
        super().__init__()

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        try:
            (self.marks / "hung-in-build").touch(exist_ok=False)
        except FileExistsError:
            return super().build()
        signal_this_process(signal.SIGSTOP)
        return super().build()


class Strander(Actor):
    """Leaves gloo calls in flight, as a replica stopped mid-wait does: a collective that
    never completes, a rendezvous whose peer never comes. Each sets its key in the store as
    it starts to wait; an exit handler sets one as the proc exits."""

    @concurrent_endpoint
    def wait_in_a_collective(self, store: Addresses, tag: str) -> None:
        atexit.register(_say_waiting, store, f"{tag}-exit-handler")  # before any gloo call
        timeout = datetime.timedelta(seconds=60)
        groups: list[Any] = [None, None]

        def join(rank: int) -> None:
            client = StoreClient(store, 60.0)
            prefixed = dist.PrefixStore(tag, client)  # type: ignore[attr-defined]
            groups[rank] = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)

        joins = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
        for thread in joins:
            thread.start()
        for thread in joins:
            thread.join()
        never = groups[0].barrier()  # rank 1 never enters it
        _say_waiting(store, f"{tag}-collective")
        wait_unless_aborted(never, lambda: None)

    @concurrent_endpoint
    def wait_in_a_rendezvous(self, store: Addresses, tag: str) -> None:
        _say_waiting(store, f"{tag}-rendezvous")
        open_group(store, 7, 0, 2, 60, lambda: None)


def _say_waiting(store: Addresses, key: str) -> None:
    client = StoreClient(store, 60.0)
    client.set(key, b"1")
    client.close()
