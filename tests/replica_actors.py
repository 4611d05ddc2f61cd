"""Replicas for tests/test_replicas.py (importable by procs: they unpickle these classes)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import actors
import torch

from mesh import concurrent_endpoint, context, current_rank, endpoint
from mesh.testing import signal_this_process
from recovery import Replica


class Trainer(Replica):
    """A small MLP regression on synthetic batches, deterministic in (step, shard)."""

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def loss(self, model: torch.nn.Module, step: int, shard: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(step * 1009 + shard)
        inputs = torch.randn(16, 8, generator=generator)
        return torch.nn.functional.mse_loss(model(inputs), inputs.sum(1, keepdim=True).cos())


class AllocatingTrainer(Trainer):
    """A trainer that can say how many page faults big allocations cost in its proc."""

    @endpoint
    def faults_of_allocations(self, mib: int, rounds: int) -> int:
        return actors.faults_of_allocations(mib, rounds)


class DyingTrainer(Trainer):
    """Kills its own process at chosen (step, phase) points, once each (a marker file in
    `marks` remembers that it happened, so the replacement does not die again)."""

    def __init__(self, plan: dict[int, list[tuple[int, str]]], marks: str) -> None:
        super().__init__()
        self.plan = plan
        self.marks = Path(marks)

    def on_phase(self, phase: str, step: int) -> None:
        if (step, phase) not in [tuple(p) for p in self.plan.get(self.replica_id, [])]:
            return
        mark = self.marks / f"{self.replica_id}-{step}-{phase}"
        try:
            mark.touch(exist_ok=False)
        except FileExistsError:
            return
        signal_this_process(signal.SIGKILL)


class HealsNoted(DyingTrainer):
    """`DyingTrainer` that says the step its latest heal reached (None: never healed)."""

    @endpoint
    def last_healed(self) -> int | None:
        return None if self.last_heal is None else self.last_heal.step


class CountsForwards(DyingTrainer):
    """`DyingTrainer` that also notes each forward pass it makes: a line with the step in the
    file `forwards-<replica id>` of `marks`."""

    def on_phase(self, phase: str, step: int) -> None:
        if phase == "forward":
            with open(self.marks / f"forwards-{self.replica_id}", "a") as noted:
                noted.write(f"{step}\n")
        super().on_phase(phase, step)


class DriftsOutsideGradient(Trainer):
    """`Trainer` whose forward pass also counts itself in a buffer: its state changes outside
    the averaged gradient (as with running statistics), so a spare cannot follow it by
    applying the updates alone. A discarded step puts the buffer back, as any buffer."""

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model, optimizer = super().build()
        model.register_buffer("forwards", torch.zeros(1))
        return model, optimizer

    def loss(self, model: torch.nn.Module, step: int, shard: int) -> torch.Tensor:
        model.forwards += 1
        return super().loss(model, step, shard)


class DiesFollowing(DyingTrainer):
    """`DyingTrainer`, and the first spare (per `marks` directory) to follow the group kills
    its own process as it starts to."""

    def on_phase(self, phase: str, step: int) -> None:
        if phase == "follow":
            try:
                (self.marks / "died-following").touch(exist_ok=False)
            except FileExistsError:
                return
            signal_this_process(signal.SIGKILL)
        super().on_phase(phase, step)


class LagsFollowing(DyingTrainer):
    """`DyingTrainer` keeping 8 updates, whose spare follows every 4 steps and, the first time
    it is asked to reach step 8 or later, takes 3 s to start applying (on its following
    thread; `following` in `marks` says when): it lags by up to the whole log. Each follow
    notes its thread's nice value in `follow-nice`."""

    standby_updates = 8
    standby_follow_every = 4

    def on_phase(self, phase: str, step: int) -> None:
        if phase == "follow":
            nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            with open(self.marks / "follow-nice", "a") as noted:
                noted.write(f"{nice}\n")
            if step >= 8 and not (self.marks / "following").exists():
                (self.marks / "following").touch()
                time.sleep(3.0)
        super().on_phase(phase, step)


class StarvedFollowing(DyingTrainer):
    """`DyingTrainer` keeping 8 updates, whose spare follows every 2 steps and, the first time
    it is asked to reach step 4 or later, takes 3 s to start applying (its following thread
    gets no CPU, as at nice 19 on cores the replicas fill; `held`, which holds that step, and
    `released` in `marks` say when).
    `last_healed` is the step its latest heal reached (None: never healed)."""

    standby_updates = 8
    standby_follow_every = 2

    def on_phase(self, phase: str, step: int) -> None:
        if phase == "follow" and step >= 4 and not (self.marks / "held").exists():
            (self.marks / "held").write_text(str(step))
            time.sleep(3.0)
            (self.marks / "released").touch()
        super().on_phase(phase, step)

    @endpoint
    def last_healed(self) -> int | None:
        return None if self.last_heal is None else self.last_heal.step


class DiesWhileBuilt(Trainer):
    """The first replica built (per `marks` directory) kills its own process in build(), so
    the group loses it while it starts."""

    def __init__(self, marks: str) -> None:
        self.marks = Path(marks)
        super().__init__()

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        try:
            (self.marks / "died-in-build").touch(exist_ok=False)
        except FileExistsError:
            return super().build()
        signal_this_process(signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL cannot be caught")


class GatedReplacement(Trainer):
    """The first `initial` replicas build at once; any later one (a replacement) waits in
    build() until the file `gate` exists (at most a minute), so a test decides when it comes."""

    def __init__(self, marks: str, gate: str, initial: int) -> None:
        self.marks, self.gate, self.initial = Path(marks), Path(gate), initial
        super().__init__()

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        index = 0
        while True:
            try:
                (self.marks / f"built-{index}").touch(exist_ok=False)
                break
            except FileExistsError:
                index += 1
        deadline = time.monotonic() + 60.0
        while index >= self.initial and not self.gate.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return super().build()


class HeldHeals(Trainer):
    """As a donor, sends no chunk of a heal while the file `hold` exists (at most 30 s), so a
    test decides how long a replacement's heal lasts; `hold` + ".asked" says one was asked,
    `hold` + ".expired" that a hold ran out of time."""

    def __init__(self, hold: str) -> None:
        self.hold = Path(hold)
        super().__init__()
        self.built_uninitialised = self._uninitialised  # (a heal clears it)

    def on_phase(self, phase: str, step: int) -> None:
        if phase == "heal" and self.hold.exists():
            self.hold.with_suffix(".asked").touch()  # a replacement runs and asks for its state
        deadline = time.monotonic() + 30.0
        while phase == "heal" and self.hold.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        if phase == "heal" and self.hold.exists():
            self.hold.with_suffix(".expired").touch()

    @endpoint
    def skipped_init(self) -> bool:
        """Whether this actor built its model with random initialisations skipped."""
        return self.built_uninitialised

    @endpoint
    def healed_to(self) -> int | None:
        """The step this replica's last heal brought it to (None: it never healed)."""
        return None if self.last_heal is None else self.last_heal.step


class HeldExchanges(HeldHeals):
    """`HeldHeals` whose replicas also wait before each exchange while the file `hold` +
    ".exchange" exists (at most 30 s; `hold` + ".waiting" says one waits), so that a test
    keeps a step in flight. Each forward pass is noted: a line "<replica id> <step> <thread
    name>" in `hold` + ".forwards"."""

    def on_phase(self, phase: str, step: int) -> None:
        held = self.hold.with_suffix(".exchange")
        if phase == "forward":
            with self.hold.with_suffix(".forwards").open("a") as noted:
                noted.write(f"{self.replica_id} {step} {threading.current_thread().name}\n")
        if phase == "allreduce" and held.exists():
            self.hold.with_suffix(".waiting").touch()
            deadline = time.monotonic() + 30.0
            while held.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        super().on_phase(phase, step)


class HeldLoads(HeldExchanges):
    """`HeldExchanges` whose replacements (a restarted proc) wait as they take a data position
    (`load_data_state`: at a heal's end, after each update its catch-up applies): the k-th
    time until the file `hold` + ".go-<k>" exists, having touched `hold` + ".loading-<k>"
    (at most 30 s each; `hold` + ".go-all" lets every later one through), so that a test
    commits a step of the group during each."""

    def __init__(self, hold: str) -> None:
        super().__init__(hold)
        self.loads = 0

    def load_data_state(self, state: object) -> None:
        if context().restart_count == 0 or self.hold.with_suffix(".go-all").exists():
            return
        self.loads += 1
        self.hold.with_suffix(f".loading-{self.loads}").touch()
        go, deadline = self.hold.with_suffix(f".go-{self.loads}"), time.monotonic() + 30.0
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)


class HeldStandBy(Trainer):
    """A spare forms no standing group while the file `hold` exists (at most two minutes), so
    a test decides when the groups of its take-overs form; `hold` + ".asked" gets a line per
    formation asked of a spare, `hold` + ".timed-out" says that the hold ran out."""

    def __init__(self, hold: str) -> None:
        self.hold = Path(hold)
        super().__init__()

    def on_phase(self, phase: str, step: int) -> None:
        if phase != "stand_by" or self.replica_id >= 0 or not self.hold.exists():
            return
        with self.hold.with_suffix(".asked").open("a") as asked:
            asked.write(f"{os.getpid()}\n")
        deadline = time.monotonic() + 120.0
        while self.hold.exists():
            if time.monotonic() > deadline:
                self.hold.with_suffix(".timed-out").touch()
                return
            time.sleep(0.01)


class BrokenTrainer(Replica):
    """A replica whose subclass forgot to implement build()."""


class Announced(Trainer):
    """Writes `built-<pid>` into `marks` as it is built, so a test sees a replacement run
    without stepping the group."""

    def __init__(self, marks: str) -> None:
        (Path(marks) / f"built-{os.getpid()}").touch()
        super().__init__()

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        self.init_skipped = bool(torch.nn.init.uniform_(torch.zeros(4)).eq(0).all())
        return super().build()

    @endpoint
    def skipped_init(self) -> bool:
        """Whether this replica's build skipped random initialisations (a replacement's)."""
        return self.init_skipped


class LateSurvivingRank(DyingTrainer):
    """Replicas of two ranks, where rank 1 of replica 1 lives on when rank 0 of its replica
    dies (only the dead proc is re-spawned) and begins its prepare of step 2 late, as a
    loaded machine may run it: once its replica's heal has begun (replica 0's rank 1 sends
    it a chunk of a step). That heal waits until the late prepare has ended (at most 30 s
    each), so the late attempt at the discarded step runs after the heal began, before it
    ends."""

    def __init__(self, plan: dict[int, list[tuple[int, str]]], marks: str) -> None:
        super().__init__(plan, marks)
        self.rank_in_replica = current_rank().rank

    def on_phase(self, phase: str, step: int) -> None:
        if (phase, self.replica_id, self.rank_in_replica) == ("heal", 0, 1) and step > 0:
            (self.marks / "healing").touch()
            _wait_for(self.marks / "late-prepare-ended")
        super().on_phase(phase, step)

    @concurrent_endpoint
    def prepare(self, step: int, quorum: int, world: int, exchange: bool = True) -> None:
        late = (self.replica_id, self.rank_in_replica, step) == (1, 1, 2)
        if late and not (self.marks / "late-prepare-ended").exists():
            _wait_for(self.marks / "healing")
            try:
                super().prepare(step, quorum, world, exchange)
            finally:
                (self.marks / "late-prepare-ended").touch()
            return
        super().prepare(step, quorum, world, exchange)


def _wait_for(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
