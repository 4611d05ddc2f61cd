"""Replicas for tests/test_heal.py: a big state that reports its memory, a donor that dies
mid-heal, and a replica that reads batches from a data loader and draws random numbers."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy
import torch
from replica_actors import DyingTrainer, Trainer

from mesh import endpoint
from mesh.testing import signal_this_process
from recovery import HealReport


class BigTrainer(Trainer):
    """A ~200 MB state (a 4096x4096 layer and Adam's two moments) that reports its memory:
    the peak resident size is reset when it is built and on request (Linux clear_refs)."""

    def __init__(self) -> None:
        super().__init__()
        self.rss_built = reset_peak_rss()

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 1))
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)

    def loss(self, model: torch.nn.Module, step: int, shard: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(step * 1009 + shard)
        inputs = torch.randn(4, 4096, generator=generator)
        return model(inputs).pow(2).mean()

    @endpoint
    def reset_peak(self) -> int:
        return reset_peak_rss()

    @endpoint
    def memory(self) -> dict[str, Any]:
        """Resident bytes when built, peak since the last reset, the last heal's report, and
        the bytes of the parameters."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        with self._stepping:  # a replacement's warm-up and first gradient (`_ahead`) are done
            pass
        return {
            "built": self.rss_built,
            "peak": rss_kb("VmHWM"),
            "heal": self.last_heal,
            "params": params,
        }


def rss_kb(field: str) -> int:
    """A size from /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> int:
    """Reset this process's peak resident size to the current one; returns it."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_kb("VmRSS")


class DonorDiesMidHeal(Trainer):
    """Heals in tiny chunks, one in flight per peer; replica `victim` kills its own process as
    it serves its third chunk of a heal (once per `marks` directory)."""

    heal_chunk_bytes = 96
    heal_window = 1

    def __init__(self, victim: int, marks: str) -> None:
        super().__init__()
        self.victim = victim
        self.marks = Path(marks)
        self.served = 0

    def on_phase(self, phase: str, step: int) -> None:
        if phase != "heal" or self.replica_id != self.victim:
            return
        self.served += 1
        if self.served == 3 and not (self.marks / "donor-died").exists():
            (self.marks / "donor-died").touch()
            signal_this_process(signal.SIGKILL)

    @endpoint
    def last_heal_report(self) -> Any:
        return self.last_heal


class LoaderTrainer(DyingTrainer):
    """Reads its shard's batches from a torch DataLoader (shuffled per epoch) and adds noise
    from torch (dropout), numpy and random; logs (step, batch ids, noise) of every attempt.
    Its data position is the number of batches read: `load_data_state` rebuilds the loader
    there without reading the batches before it."""

    dataset_size = 24
    batch_size = 4

    def __init__(self, plan: dict[int, list[tuple[int, str]]], marks: str) -> None:
        super().__init__(plan, marks)
        self.batches_read = 0
        self.seen: list[tuple[int, tuple[int, ...], float]] = []
        self._batches: Any = None

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        numpy.random.seed(0)
        random.seed(0)
        return super().build()  # seeds torch

    def data_state(self) -> Any:
        return {"batches_read": self.batches_read}

    def load_data_state(self, state: Any) -> None:
        self.batches_read = state["batches_read"]
        self._batches = None

    def _loader(self, shard: int) -> Any:
        """The batches of `shard` from position `batches_read` on, epoch after epoch."""
        per_epoch = self.dataset_size // self.batch_size
        epoch, skip = divmod(self.batches_read, per_epoch)
        ids = torch.arange(self.dataset_size) + 1000 * shard
        inputs = torch.stack([torch.linspace(-1, 1, 8) * (i % 97) / 97 for i in ids.tolist()])
        data = torch.utils.data.TensorDataset(ids, inputs)
        while True:
            order = torch.randperm(
                self.dataset_size, generator=torch.Generator().manual_seed(shard * 7919 + epoch)
            )[skip * self.batch_size :].tolist()
            loader = torch.utils.data.DataLoader(  # its own generator: no global RNG draw
                data, batch_size=self.batch_size, sampler=order, generator=torch.Generator()
            )
            yield from loader
            epoch, skip = epoch + 1, 0

    def loss(self, model: torch.nn.Module, step: int, shard: int) -> torch.Tensor:
        if self._batches is None:
            self._batches = self._loader(shard)
        ids, inputs = next(self._batches)
        self.batches_read += 1
        noise = torch.rand(()).item() + numpy.random.rand() + random.random()
        self.seen.append((step, tuple(ids.tolist()), float(noise)))
        out = torch.nn.functional.dropout(model(inputs), p=0.2, training=True)
        return out.pow(2).mean() + noise * 1e-3

    @endpoint
    def seen_batches(self) -> list[tuple[int, tuple[int, ...], float]]:
        return self.seen


class WiderTrainer(Trainer):
    """A replica whose model is wider than `Trainer`'s: it cannot heal from one."""

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.Tanh(), torch.nn.Linear(17, 1))
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)


class HeldAfterFirstChunk(Trainer):
    """Heals in 64-byte chunks, one in flight per peer. As a donor, once the file `hold`
    exists, each proc serves one chunk, then none while `hold` exists (at most 30 s; `hold` +
    ".asked" says a request waits), so that a test commits a step in the middle of a heal."""

    heal_chunk_bytes = 64
    heal_window = 1
    free_chunks = 1  # served before the hold

    def __init__(self, hold: str) -> None:
        self.hold = Path(hold)
        self.served = 0
        super().__init__()

    def on_phase(self, phase: str, step: int) -> None:
        if phase != "heal" or not self.hold.exists():
            return
        self.served += 1
        if self.served > self.free_chunks:
            self.hold.with_suffix(".asked").touch()
            deadline = time.monotonic() + 30.0
            while self.hold.exists() and time.monotonic() < deadline:
                time.sleep(0.01)

    @endpoint
    def healed_to(self) -> int | None:
        """The step this replica's last heal brought it to (None: it never healed)."""
        return None if self.last_heal is None else self.last_heal.step

    @endpoint
    def heal_report(self) -> HealReport | None:
        return self.last_heal


class HeldAfterFirstParameter(HeldAfterFirstChunk):
    """`HeldAfterFirstChunk` whose two donors serve 13 chunks each (1664 bytes) before the
    hold: the first parameter and its optimizer state (1540 bytes), and part of the next."""

    free_chunks = 13


class HeldAfterFirstChunkScheduled(HeldAfterFirstParameter):
    """`HeldAfterFirstChunk` whose learning rate a schedule sets as each step is applied: the
    optimizer's state changes outside the averaged gradients, so a replacement cannot be
    caught up with them alone (it applies them at the rate of the step it healed at)."""

    def on_phase(self, phase: str, step: int) -> None:
        if phase == "apply":
            for group in self.optimizer.param_groups:
                group["lr"] = 1e-2 * 0.5**step
        super().on_phase(phase, step)


class HeldAtFirstChunk(HeldAfterFirstChunk):
    """`HeldAfterFirstChunk` whose donors serve no chunk before the hold: a heal has its
    layout, and nothing else, when the group commits."""

    free_chunks = 0
