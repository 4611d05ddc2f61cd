"""Where a replica is in its run besides its tensors: its data position and its RNG states.

A replacement takes these from a live peer when it heals, so it draws the batches and random
numbers the group draws next; a discarded step puts them back as they were before it, so the
retry sees the same batch and the same random numbers. The data position comes from the
replica (`Replica.data_state` / `Replica.load_data_state`); the RNG states are those of torch
(CPU and every initialized CUDA device), numpy's global generator if numpy is in use, and
Python's `random`.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from typing import Any, Protocol


class DataPositioned(Protocol):
    """What a replica offers to save and restore its data loader's position."""

    def data_state(self) -> Any: ...

    def load_data_state(self, state: Any) -> None: ...


@dataclass(frozen=True)
class Position:
    """A replica's data position and RNG states at one moment (small: a few kilobytes)."""

    data: Any
    torch_cpu: bytes
    torch_cuda: tuple[bytes, ...] | None  # one per device; None where CUDA is not in use
    numpy: Any  # numpy.random.get_state(), or None where numpy was not imported
    python: Any  # random.getstate()


def capture_position(replica: DataPositioned) -> Position:
    """The data position of `replica` and this process's RNG states, now."""
    import torch

    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        cuda = tuple(_bytes(state) for state in torch.cuda.get_rng_state_all())
    numpy = sys.modules.get("numpy")
    return Position(
        data=replica.data_state(),
        torch_cpu=_bytes(torch.get_rng_state()),
        torch_cuda=cuda,
        numpy=numpy.random.get_state() if numpy is not None else None,
        python=random.getstate(),
    )


def restore_position(replica: DataPositioned, position: Position) -> None:
    """Put `replica`'s data position and this process's RNG states back to `position`."""
    import torch

    replica.load_data_state(position.data)
    torch.set_rng_state(_tensor(position.torch_cpu))
    if position.torch_cuda is not None:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(position.torch_cuda):
            raise RuntimeError(
                f"the peer's RNG states cover {len(position.torch_cuda)} CUDA devices but "
                f"this process sees {torch.cuda.device_count()}: give every replica the same "
                "devices"
            )
        torch.cuda.set_rng_state_all([_tensor(state) for state in position.torch_cuda])
    if position.numpy is not None:
        import numpy

        numpy.random.set_state(position.numpy)
    random.setstate(position.python)


def _bytes(state: Any) -> bytes:
    """The bytes of a uint8 RNG-state tensor (without numpy)."""
    return bytes(state.cpu().tolist())


def _tensor(state: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(state), dtype=torch.uint8)
