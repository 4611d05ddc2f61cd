"""The step arithmetic of a replica, shared with `replay_training`: the local gradient, the
update with an averaged gradient, the parameter digest, and the buffers a forward pass changes.

The gradient is written straight into one flat tensor (each parameter's ``.grad`` is a view of
it while the backward pass accumulates), and the averaged gradient reaches the optimizer as
views of the exchange's result: the step copies no gradient of its own.
"""

from __future__ import annotations

import ctypes
import hashlib
import zlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def local_gradient(
    model: torch.nn.Module, loss: torch.Tensor, flat: torch.Tensor | None = None
) -> torch.Tensor:
    """The gradient of `loss` over the model's parameters, as one flat tensor: `flat` (reused
    from the last call, so the same memory every step) when it fits, else a new one."""
    params = list(model.parameters())
    if flat is None or not _fits(flat, params):
        flat = _flat_like(params)
    flat.zero_()
    slices = _attach(params, flat)
    loss.backward()  # type: ignore[no-untyped-call]
    for param, part in zip(params, slices):  # a grad autograd made anew, not accumulated
        grad = param.grad
        if grad is not None and grad.data_ptr() != part.data_ptr():
            part.copy_(grad.reshape(part.shape))
    return flat


def flat_gradient(model: torch.nn.Module) -> torch.Tensor:
    """A zeroed flat gradient of `model`'s parameters, its memory written once (no page
    faults left for the first `local_gradient` that reuses it)."""
    return _flat_like(list(model.parameters()))


def _fits(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> bool:
    return flat.numel() == sum(p.numel() for p in params) and all(
        p.dtype == flat.dtype and p.device == flat.device for p in params
    )


def _flat_like(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """A flat gradient for `params`, of the type `torch.cat` of their gradients would have."""
    import torch

    if not params:
        return torch.zeros(0)
    dtype = params[0].dtype
    for param in params[1:]:
        dtype = torch.promote_types(dtype, param.dtype)
    numel = sum(p.numel() for p in params)
    return torch.zeros(numel, dtype=dtype, device=params[0].device)


def _attach(params: Sequence[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's slice of `flat`. A trainable parameter of the same type gets it as its
    grad, which the backward pass adds into in place; others start without a grad."""
    slices = []
    offset = 0
    for param in params:
        part = flat[offset : offset + param.numel()].view_as(param)
        offset += param.numel()
        same = param.dtype == flat.dtype and param.device == flat.device
        param.grad = part if param.requires_grad and same else None
        slices.append(part)
    return slices


def flatten_gradients(
    params: Sequence[torch.Tensor], flat: torch.Tensor | None = None
) -> torch.Tensor:
    """The gradients of `params` (zeros where one has none) copied into one flat tensor:
    `flat` (reused from the last call, so the same memory every step) when it fits."""
    if flat is None or not _fits(flat, params):
        flat = _flat_like(params)
    offset = 0
    for param in params:
        part = flat[offset : offset + param.numel()]
        offset += param.numel()
        if param.grad is None:
            part.zero_()
        elif param.grad.data_ptr() != part.data_ptr():
            part.copy_(param.grad.reshape(-1))
    return flat


def use_average(params: Sequence[torch.Tensor], averaged: torch.Tensor) -> None:
    """Make each of `params`' grad a view of its slice of the flat `averaged` gradient (the
    optimizer only reads it: no copy)."""
    offset = 0
    for param in params:
        count = param.numel()
        param.grad = averaged[offset : offset + count].view_as(param).to(param.dtype)
        offset += count


def apply_average(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, averaged: torch.Tensor
) -> None:
    """Take an optimizer step with the flat averaged gradient `averaged` (each parameter's
    grad a view of its slice: the optimizer only reads it)."""
    use_average(list(model.parameters()), averaged)
    optimizer.step()


#: The digest hashes each tensor in pieces of this many bytes, numbered over the sorted
#: tensors, so that several replicas can share the work of one digest (`digest_part`).
DIGEST_PIECE_BYTES = 8 << 20

#: What `digest_part` returns: (piece number, its entry), for `combine_digest`.
DigestEntries = list[tuple[int, str]]


def digest(model: torch.nn.Module) -> str:
    """A fingerprint of the parameters' bits, to find replicas that diverged: the CRC-32 of
    each piece of each tensor's bytes (about 6x faster than SHA-256 here, and a spare's check
    hashes a whole model every few steps), with the tensor's name, dtype and shape, hashed
    together. Torch alone is enough (no numpy): memory is read in place, through ctypes."""
    return combine_digest(digest_part(model, 0, 1))


def digest_part(
    model: torch.nn.Module, part: int, parts: int, piece_bytes: int = DIGEST_PIECE_BYTES
) -> DigestEntries:
    """The entries of the pieces numbered `part` modulo `parts`: `parts` replicas holding the
    same bits each hash one share, and `combine_digest` of all the shares is `digest` (for
    the default `piece_bytes`; other sizes give other digests, for tests)."""
    entries: DigestEntries = []
    number = 0
    for name, tensor in sorted(model.state_dict().items()):
        count = max(1, -(-tensor.numel() * tensor.element_size() // piece_bytes))
        mine = [k for k in range(count) if (number + k) % parts == part]
        if mine:
            entries += _piece_entries(name, tensor, number, mine, piece_bytes)
        number += count
    return entries


def _piece_entries(
    name: str, tensor: torch.Tensor, number: int, pieces: Sequence[int], piece_bytes: int
) -> DigestEntries:
    dense = tensor.detach().resolve_conj().resolve_neg().contiguous().cpu()
    head = f"{name}|{dense.dtype}|{tuple(dense.shape)}"
    memory = memoryview(b"")
    if dense.nbytes:  # `dense` outlives the view: it owns the memory read
        memory = memoryview((ctypes.c_ubyte * dense.nbytes).from_address(dense.data_ptr()))
    found = []
    for k in pieces:
        piece = memory[k * piece_bytes : (k + 1) * piece_bytes]
        found.append((number + k, f"{head}|{k}|{zlib.crc32(piece):08x};"))
    return found


def commit_digest(
    model: torch.nn.Module, wanted: bool | tuple[int, int]
) -> str | DigestEntries | None:
    """`digest` if `wanted` is True, share (part, parts) of it if a pair, None if False."""
    if wanted is True:
        return digest(model)
    return digest_part(model, *wanted) if wanted else None


def combine_digest(entries: Iterable[tuple[int, str]]) -> str:
    """The digest of a model whose pieces' entries (`digest_part`, from one replica or
    several) are `entries`."""
    hasher = hashlib.sha256()
    for _, entry in sorted(entries):
        hasher.update(entry.encode())
    return hasher.hexdigest()


def save_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of the model's buffers (running statistics a forward pass may update), to put
    back if the step is discarded. Small next to the parameters, often empty."""
    return [buffer.detach().clone() for buffer in model.buffers()]


def restore_buffers(model: torch.nn.Module, saved: list[torch.Tensor]) -> None:
    """Put back the buffers `save_buffers` copied."""
    for buffer, value in zip(model.buffers(), saved):
        buffer.data.copy_(value)
