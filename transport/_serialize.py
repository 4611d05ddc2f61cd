"""Values to bytes and back: cloudpickle bodies with pickle protocol-5 out-of-band buffers.

Large contiguous buffers (bytes, bytearray, memoryview, numpy arrays, CPU torch tensors) are not
copied into the pickle stream; they travel as separate frames. A socket copies such a frame
once as it sends it (so the sender may change its value right after), except a `Lent` one,
which goes straight from its owner's memory (see `_lending`).
"""

from __future__ import annotations

import io
import pickle
import reprlib
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any

import cloudpickle

from ._errors import SerializationError, safe_str
from ._lending import unwrap_lent

#: Buffers smaller than this are cheaper to copy into the pickle stream than to send alone.
OUT_OF_BAND_MIN_BYTES = 2048


#: The pickler handles bytes and bytearray itself (no hook sees them), so large ones are
#: lifted out of containers this deep and this small before pickling.
_LIFT_DEPTH = 3
_LIFT_MAX_ITEMS = 64


class _OutOfBand:
    """A large bytes or bytearray value to be sent as its own frame."""

    __slots__ = ("value",)

    def __init__(self, value: bytes | bytearray) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        rebuild = _rebuild_bytes if type(self.value) is bytes else _rebuild_bytearray
        return rebuild, (pickle.PickleBuffer(self.value),)


def _has_large_bytes(value: Any, depth: int = _LIFT_DEPTH) -> bool:
    """Whether `_lift` would change anything (cheap: allocates nothing)."""
    kind = type(value)
    if kind is bytes or kind is bytearray:
        return len(value) >= OUT_OF_BAND_MIN_BYTES
    if depth == 0 or kind not in (tuple, list, dict) or len(value) > _LIFT_MAX_ITEMS:
        return False
    items = value.values() if kind is dict else value
    return any(_has_large_bytes(item, depth - 1) for item in items)


def _lift(value: Any, depth: int = _LIFT_DEPTH, memo: dict[int, Any] | None = None) -> Any:
    """A copy of `value` with large bytes/bytearray wrapped as `_OutOfBand`, keeping the shape
    of the object graph (shared sub-objects stay shared, cycles stay cycles)."""
    memo = {} if memo is None else memo
    found = memo.get(id(value))
    if found is not None:
        return found
    kind = type(value)
    if kind is bytes or kind is bytearray:
        lifted: Any = _OutOfBand(value) if len(value) >= OUT_OF_BAND_MIN_BYTES else value
    elif depth == 0 or kind not in (tuple, list, dict) or len(value) > _LIFT_MAX_ITEMS:
        return value
    elif kind is list:
        lifted = memo[id(value)] = []
        lifted.extend(_lift(item, depth - 1, memo) for item in value)
    elif kind is dict:
        lifted = memo[id(value)] = {}
        lifted.update((k, _lift(v, depth - 1, memo)) for k, v in value.items())
    else:
        lifted = tuple(_lift(item, depth - 1, memo) for item in value)
    memo[id(value)] = lifted
    return lifted


class _Pickler(cloudpickle.Pickler):  # type: ignore[misc]
    """cloudpickle plus out-of-band reductions for buffers and CPU tensors."""

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is memoryview and obj.nbytes >= OUT_OF_BAND_MIN_BYTES and obj.contiguous:
            return _rebuild_bytes, (pickle.PickleBuffer(obj.cast("B")),)
        torch = sys.modules.get("torch")
        if torch is not None and kind in (torch.Tensor, torch.nn.Parameter):
            reduced = _reduce_tensor(torch, obj)
            if reduced is not None:
                return reduced
        if kind is types.CodeType:
            return self._reduce_code(obj)
        return super().reducer_override(obj)

    def _reduce_code(self, code: types.CodeType) -> Any:
        """cloudpickle's reduction of `code`, keeping its file name: newer cloudpickle writes
        "<dynamic-code>", and a traceback in another process would lose its source lines."""
        rebuild, args = self.dispatch_table[types.CodeType](code)
        return rebuild, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _ReusablePickler(threading.local):
    """One pickler per thread, reused: building a cloudpickle Pickler costs more than a small
    message's whole pickling."""

    def __init__(self) -> None:
        self.stream = io.BytesIO()
        self.buffers: list[pickle.PickleBuffer] = []
        self.pickler = _Pickler(self.stream, protocol=5, buffer_callback=self.buffers.append)
        self.busy = False


_reusable = _ReusablePickler()


def serializing_now() -> bool:
    """Whether this thread is pickling a value (user code may run in its ``__reduce__``): an
    exception that a signal handler raised now would be taken for the value's own error."""
    return _reusable.busy


_PLAIN_SCALARS = frozenset({type(None), bool, int, float, str, complex})
_CONTAINERS = frozenset({tuple, list, dict})


def _is_plain(value: Any, depth: int = _LIFT_DEPTH) -> bool:
    """Builtins only (small containers of scalars and small bytes): the C pickler alone
    serializes these exactly as cloudpickle would, several times faster. Plain loops, and no
    call for the items that need no look inside (scalars, small bytes, empty containers):
    this runs for every message."""
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return True
    if kind is bytes:
        return len(value) < OUT_OF_BAND_MIN_BYTES
    if depth == 0 or kind not in _CONTAINERS or len(value) > _LIFT_MAX_ITEMS:
        return False
    if kind is dict:
        for key in value:
            if type(key) is not str:
                return False
        value = value.values()
    for item in value:
        inner = type(item)
        if inner in _PLAIN_SCALARS:
            continue
        if inner is bytes:
            if len(item) >= OUT_OF_BAND_MIN_BYTES:
                return False
        elif (inner not in _CONTAINERS or item) and not _is_plain(item, depth - 1):
            return False
    return True


def dumps(value: Any) -> tuple[bytes, list[Any]]:
    """Serialize `value` into a pickle body and its out-of-band buffers (a `Lent` value's
    as a zmq frame, which sockets send without a copy)."""
    if _is_plain(value):
        return pickle.dumps(value, protocol=5), []
    state = _reusable
    if state.busy:  # pickling re-entered this thread (a __reduce__ that sends): use a fresh one
        buffers: list[pickle.PickleBuffer] = []
        stream = io.BytesIO()
        _dump(_Pickler(stream, protocol=5, buffer_callback=buffers.append), value)
        return stream.getvalue(), unwrap_lent(buffers) if buffers else buffers
    state.busy = True
    try:
        _dump(state.pickler, value)
        buffers = state.buffers
        return state.stream.getvalue(), unwrap_lent(buffers) if buffers else []
    finally:
        state.stream.seek(0)
        state.stream.truncate()
        state.buffers.clear()
        state.pickler.clear_memo()
        state.busy = False


def _dump(pickler: _Pickler, value: Any) -> None:
    try:
        pickler.dump(_lift(value) if _has_large_bytes(value) else value)
    except Exception as exc:
        raise SerializationError(
            f"cannot serialize {_describe(value)}: {type(exc).__name__}: "
            f"{safe_str(exc).rstrip('.')}. Arguments and results must be picklable by "
            "cloudpickle (no open files, sockets, locks or generators)."
        ) from exc


def loads(body: bytes | memoryview, buffers: Sequence[Any] = ()) -> Any:
    """Rebuild a value from the output of `dumps`."""
    return pickle.loads(body, buffers=buffers)


_short_repr = reprlib.Repr()
_short_repr.maxlevel = 3
_short_repr.maxother = _short_repr.maxstring = 80


def _describe(value: Any) -> str:
    """A short description of `value` that cannot fail: reprlib bounds the depth (a deeply
    nested value) and survives a broken ``__repr__``."""
    try:
        text = _short_repr.repr(value)
    except Exception as exc:  # reprlib falls back on repr() for some types
        text = f"<repr() failed: {type(exc).__name__}>"
    return f"{type(value).__name__} value {text[:80]}{'...' if len(text) > 80 else ''}"


def _rebuild_bytes(buffer: Any) -> bytes:
    return bytes(buffer)


def _rebuild_bytearray(buffer: Any) -> bytearray:
    return bytearray(buffer)


def _reduce_tensor(torch: Any, tensor: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """Reduce a dense CPU tensor to a raw out-of-band buffer; None means use torch's own."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
        return None
    if tensor.requires_grad and tensor.grad_fn is not None:
        return None  # torch's own reducer refuses non-leaf tensors with a clear message
    if tensor.nbytes < OUT_OF_BAND_MIN_BYTES:
        return None
    try:
        import numpy  # noqa: F401  (tensor.numpy() needs it)
    except ImportError:
        return None
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy()
    is_param = type(tensor) is torch.nn.Parameter
    args = (pickle.PickleBuffer(raw), str(flat.dtype), tuple(tensor.shape), tensor.requires_grad)
    return (_rebuild_parameter if is_param else _rebuild_tensor), args


def _rebuild_tensor(buffer: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    import torch

    view = memoryview(buffer)
    if view.readonly:
        view = memoryview(bytearray(view))
    raw = torch.frombuffer(view, dtype=torch.uint8)
    tensor = raw.view(getattr(torch, dtype.removeprefix("torch."))).reshape(shape)
    return tensor.requires_grad_(requires_grad)


def _rebuild_parameter(buffer: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool) -> Any:
    import torch

    return torch.nn.Parameter(_rebuild_tensor(buffer, dtype, shape, False), requires_grad)
