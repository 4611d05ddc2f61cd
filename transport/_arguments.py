"""A call's arguments, and its result, as one payload: `Payload.dump` with the plainness
check inlined, since every call and every reply pays it (for a few scalars, one Python call
instead of four or five)."""

from __future__ import annotations

import pickle
from typing import Any

from ._frames import Payload, _new, _set_body, _set_buffers
from ._serialize import (
    _CONTAINERS,
    _LIFT_DEPTH,
    _LIFT_MAX_ITEMS,
    _PLAIN_SCALARS,
    OUT_OF_BAND_MIN_BYTES,
    _is_plain,
)


def dump_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Payload:
    """The payload of a call with `args` and `kwargs`: the same bytes and buffers as
    `Payload.dump((args, kwargs))`."""
    if len(args) > _LIFT_MAX_ITEMS or (kwargs and not _is_plain(kwargs, _LIFT_DEPTH - 1)):
        return Payload.dump((args, kwargs))
    for item in args:  # as `_is_plain` looks at them, one level down
        kind = type(item)
        if kind in _PLAIN_SCALARS or (kind is bytes and len(item) < OUT_OF_BAND_MIN_BYTES):
            continue
        if kind not in _CONTAINERS or (item and not _is_plain(item, _LIFT_DEPTH - 2)):
            return Payload.dump((args, kwargs))
    payload = _new(Payload)
    _set_body(payload, pickle.dumps((args, kwargs), protocol=5))
    _set_buffers(payload, [])
    return payload


def dump_value(value: Any) -> Payload:
    """The payload of a call's result: the same bytes and buffers as `Payload.dump(value)`."""
    kind = type(value)
    if (
        kind in _PLAIN_SCALARS
        or (kind is bytes and len(value) < OUT_OF_BAND_MIN_BYTES)
        or (kind in _CONTAINERS and _is_plain(value))
    ):
        payload = _new(Payload)
        _set_body(payload, pickle.dumps(value, protocol=5))
        _set_buffers(payload, [])
        return payload
    return Payload.dump(value)
