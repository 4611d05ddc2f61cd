"""The pieces of a heal: a replica's state as a layout plus a list of tensors, cut into chunks.

The donor describes its committed state once (`describe`: every tensor's dtype and shape, the
optimizer's state with its tensors replaced by numbered slots, the data position and RNG
states) and then serves byte ranges of its tensors (`serve`), straight from their memory, as
out-of-band pickle buffers. The receiver plans fixed-size chunks over the tensors' bytes
(`plan_chunks`), preallocates where the bytes go (`Targets`: the model's own tensors, the
optimizer's if they fit, new ones otherwise) and copies each chunk in as it arrives. So no
side ever holds a second copy of the state: only the chunks in flight.
"""

from __future__ import annotations

import ctypes
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transport import Lent

from ._position import Position
from ._prefault import Prefault

if TYPE_CHECKING:
    import torch

#: (tensor index, first byte, byte after the last) of one tensor's bytes.
Piece = tuple[int, int, int]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the state: where it belongs, its dtype, shape and size in bytes."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class TensorSlot:
    """Stands for tensor `index` of the layout inside the optimizer's state skeleton."""

    index: int


@dataclass(frozen=True)
class StateLayout:
    """A replica's committed state without the tensors' bytes (a few kilobytes)."""

    step: int
    tensors: tuple[TensorSpec, ...]
    optimizer: Any  # the optimizer's state_dict, tensors replaced by TensorSlot
    position: Position

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors)


def state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[tuple[str, torch.Tensor]], Any]:
    """Every tensor of the model and optimizer state (keyed), and the optimizer's state_dict
    with its tensors replaced by `TensorSlot`s numbered after the model's tensors."""
    state = model.state_dict(keep_vars=True)  # the tensors themselves (`DonorCache.clear`)
    tensors = [(f"model.{name}", value) for name, value in state.items()]
    skeleton = _slots(optimizer.state_dict(), "optimizer", tensors)
    return tensors, skeleton


def _slots(value: Any, key: str, found: list[tuple[str, Any]]) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        found.append((key, value))
        return TensorSlot(len(found) - 1)
    if isinstance(value, dict):
        return {k: _slots(v, f"{key}.{k}", found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_slots(v, f"{key}.{i}", found) for i, v in enumerate(value))
    return value


def describe(
    step: int, tensors: Sequence[tuple[str, torch.Tensor]], skeleton: Any, position: Position
) -> StateLayout:
    specs = tuple(
        TensorSpec(key, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.nbytes)
        for key, t in tensors
    )
    return StateLayout(step, specs, skeleton, position)


def plan_chunks(
    specs: Sequence[TensorSpec], chunk_bytes: int, order: Sequence[int] | None = None
) -> list[tuple[Piece, ...]]:
    """Cut the tensors' bytes (of those `order` names, in that order; default all), taken end
    to end, into chunks of `chunk_bytes` (the last one shorter): each chunk lists the pieces of
    tensors it covers."""
    if chunk_bytes < 1:
        raise ValueError(f"a heal needs chunks of at least 1 byte, not {chunk_bytes}")
    chunks: list[tuple[Piece, ...]] = []
    current: list[Piece] = []
    room = chunk_bytes
    for index in range(len(specs)) if order is None else order:
        spec, start = specs[index], 0
        while start < spec.nbytes:
            take = min(room, spec.nbytes - start)
            current.append((index, start, start + take))
            start, room = start + take, room - take
            if room == 0:
                chunks.append(tuple(current))
                current, room = [], chunk_bytes
    if current:
        chunks.append(tuple(current))
    return chunks


class Chunk:
    """Bytes of one piece. A donor lends them to the transport (`transport.Lent`: sent from
    the tensor's memory, no copy); the receiver reads them from the received frame."""

    __slots__ = ("lent", "view")

    def __init__(self, view: memoryview, lent: Lent | None = None) -> None:
        self.view = view
        self.lent = lent

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_chunk, (self.lent or pickle.PickleBuffer(self.view),)


def _rebuild_chunk(buffer: Any) -> Chunk:
    return Chunk(memoryview(buffer).cast("B"))


def serve(tensors: Sequence[tuple[str, torch.Tensor]], pieces: Sequence[Piece]) -> list[Chunk]:
    """The bytes of `pieces`, lent from the memory of CPU tensors (copied off other devices):
    the donor must not change them until every chunk's `lent` is released."""
    chunks = []
    for piece in pieces:
        index, start, stop = _checked(tensors, piece)
        raw = flat_bytes(tensors[index][1])[start:stop]
        if raw.device.type != "cpu":
            raw = raw.cpu()
        view = memory_of(raw)
        chunks.append(Chunk(view, Lent(view)))
    return chunks


def _checked(tensors: Sequence[tuple[str, torch.Tensor]], piece: Any) -> Piece:
    if not (isinstance(piece, (tuple, list)) and len(piece) == 3):
        raise ValueError(f"a heal piece is (tensor, start, stop), not {piece!r}")
    index, start, stop = piece
    if not all(type(n) is int for n in piece) or not 0 <= index < len(tensors):
        raise ValueError(f"heal piece {piece!r} names no tensor of {len(tensors)}")
    if not 0 <= start < stop <= tensors[index][1].nbytes:
        raise ValueError(
            f"heal piece {piece!r} is outside tensor {tensors[index][0]} "
            f"({tensors[index][1].nbytes} bytes)"
        )
    return index, start, stop


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous `tensor`, as a flat uint8 view of its memory."""
    import torch

    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def memory_of(raw: torch.Tensor) -> memoryview:
    """A memoryview of a contiguous CPU uint8 tensor's memory that keeps the tensor alive."""
    array = (ctypes.c_ubyte * raw.numel()).from_address(raw.data_ptr())
    array._tensor = raw  # type: ignore[attr-defined]  # the view must not outlive the memory
    return memoryview(array).cast("B")


class Targets:
    """Where the receiver writes each tensor of `layout`: the model's own tensors, the
    optimizer's own where they match, otherwise new ones. `finish()` installs the result."""

    def __init__(
        self,
        layout: StateLayout,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        memory: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """`memory`: tensors by key to write into where this replica has none of its own
        (those of an earlier start of the heal: `by_key`), before new ones are made."""
        import torch

        self.layout = layout
        self.allocated_bytes = 0  # new tensors, for state the receiver did not have yet
        mine, _ = state_tensors(model, optimizer)
        self._device = next((t.device for _, t in mine), torch.device("cpu"))
        own = {**(memory or {}), **dict(mine)}
        models = {k for k, _ in mine if k.startswith("model.")}
        theirs = {s.key for s in layout.tensors if s.key.startswith("model.")}
        if models != theirs:
            raise ValueError(
                f"the peer's model has tensors {sorted(theirs - models)} that this one lacks "
                f"and lacks {sorted(models - theirs)}: build() must make the same model "
                "everywhere"
            )
        self.tensors = [self._target(spec, own.get(spec.key)) for spec in layout.tensors]
        self._writable = [_contiguous(t) for t in self.tensors]
        self._bytes = [flat_bytes(t) for t in self._writable]
        self._prefault = Prefault(self._writable)  # pages in place ahead of the copy

    def by_key(self) -> dict[str, torch.Tensor]:
        """The targets by key, with what was written so far, for the next part of a heal."""
        self._copy_back()
        return {spec.key: t for spec, t in zip(self.layout.tensors, self.tensors)}

    def close(self) -> None:
        """Stop making the targets' memory present (the heal ended, or failed)."""
        self._prefault.close()

    def _target(self, spec: TensorSpec, mine: torch.Tensor | None) -> torch.Tensor:
        import torch

        dtype = getattr(torch, spec.dtype)
        if mine is not None and mine.dtype == dtype and tuple(mine.shape) == spec.shape:
            return mine.detach()
        if spec.key.startswith("model."):
            raise ValueError(
                f"the peer's {spec.key} is {spec.dtype}{list(spec.shape)} but this replica's "
                f"is {str(mine.dtype if mine is not None else None).removeprefix('torch.')}"
                f"{list(mine.shape) if mine is not None else ''}: build() must make the same "
                "model everywhere"
            )
        self.allocated_bytes += spec.nbytes
        return torch.empty(spec.shape, dtype=dtype, device=self._device)

    def _copy_back(self) -> None:
        for target, written in zip(self.tensors, self._writable):
            if written is not target:
                target.copy_(written)

    def write(self, pieces: Sequence[Piece], chunks: Sequence[Chunk]) -> int:
        """Copy received `chunks` (one per piece) into place; returns the bytes written."""
        if len(chunks) != len(pieces):
            raise ValueError(f"a heal reply holds {len(chunks)} pieces for {len(pieces)} asked")
        written = 0
        for (index, start, stop), chunk in zip(pieces, chunks):
            if not isinstance(chunk, Chunk) or chunk.view.nbytes != stop - start:
                raise ValueError(
                    f"a heal reply for bytes {start}:{stop} of tensor {index} is "
                    f"{type(chunk).__name__} of the wrong size"
                )
            _copy_into(self._bytes[index], start, chunk.view)
            written += stop - start
        return written

    def finish(self, optimizer: torch.optim.Optimizer) -> None:
        """Copy back into non-contiguous targets and load the optimizer's state."""
        self.close()
        self._copy_back()
        optimizer.load_state_dict(_filled(self.layout.optimizer, self.tensors))


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _copy_into(flat: torch.Tensor, start: int, source: memoryview) -> None:
    """Copy `source` into bytes `start`.. of the flat uint8 tensor `flat` (any device)."""
    import torch

    size = source.nbytes
    if flat.device.type == "cpu":
        target = (ctypes.c_ubyte * size).from_address(flat.data_ptr() + start)
        memoryview(target).cast("B")[:] = source
        return
    staging = torch.empty(size, dtype=torch.uint8)
    memoryview((ctypes.c_ubyte * size).from_address(staging.data_ptr())).cast("B")[:] = source
    flat[start : start + size].copy_(staging)


def _filled(value: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(value, TensorSlot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _filled(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_filled(v, tensors) for v in value)
    return value
