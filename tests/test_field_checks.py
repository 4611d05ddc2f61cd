"""`invalid_fields` (checks built once per message type) agrees with the plain reading of each
type hint, field by field, for every message type and any values in its fields."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from test_agent_hardening import MESSAGE_TYPES, instances

from mesh.testing import fanout_wire as fw
from mesh.testing import wire

TYPES = [*MESSAGE_TYPES, fw.FanOut, fw.RelayedReplies]


def conforms(value: object, hint: Any) -> bool:
    """Whether `value` is of type `hint`, read from the hint afresh (the reference)."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return any(conforms(value, option) for option in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if type(value) is not tuple:
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(conforms(item, args[0]) for item in value)
        return len(value) == len(args) and all(map(conforms, value, args))
    if origin is frozenset:
        (item,) = typing.get_args(hint)
        return type(value) is frozenset and all(conforms(v, item) for v in value)
    if hint is type(None):
        return value is None
    if hint is float:
        return type(value) in (float, int)
    if hint in (int, str, bool, bytes):
        return type(value) is hint
    return type(value) is hint and first_wrong_field(value) is None


def first_wrong_field(header: object) -> str | None:
    hints = typing.get_type_hints(type(header))
    for field in dataclasses.fields(header):  # type: ignore[arg-type]
        if not conforms(getattr(header, field.name), hints[field.name]):
            return field.name
    return None


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(TYPES).flatmap(instances))
def test_a_header_is_refused_exactly_when_a_field_is_not_of_its_declared_type(header: Any) -> None:
    wrong = first_wrong_field(header)
    reason = wire.invalid_fields(header)
    if wrong is None:
        assert reason is None
    else:
        assert reason is not None and reason.startswith(
            f"field {wrong!r} of {type(header).__name__}"
        )


def test_a_tuple_of_plain_values_is_checked_item_by_item() -> None:
    call = wire.CallActor(1, None, "a", "ep", ("gpus",), (2,), 0)
    assert wire.invalid_fields(fw.FanOut(call, ("p0", "p1"), (0, 1))) is None
    for proc_ids, ranks in [(("p0", 1), (0, 1)), (("p0",), (0, True)), (("p0",), [0])]:
        reason = wire.invalid_fields(fw.FanOut(call, proc_ids, ranks))  # type: ignore[arg-type]
        assert reason is not None and "FanOut must be tuple[" in reason, reason
