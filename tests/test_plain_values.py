"""Values made of builtins take a fast path through the C pickler: it must send them exactly
as the general path would (every large bytes within reach out of band, every type kept), for
any mix of scalars, bytes, containers and values that need cloudpickle."""

from __future__ import annotations

import enum
import reprlib
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from transport import OUT_OF_BAND_MIN_BYTES, Payload, dump_arguments, dump_value

#: How deep, and into containers how small, large bytes are lifted out of band (see DESIGN).
LIFT_DEPTH, LIFT_MAX_ITEMS = 3, 64


class Colour(enum.IntEnum):
    """An int subclass: it must arrive as itself, not as an int."""

    RED = 1


class Name(str):
    """A str subclass."""


leaves = (
    st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.none()
    | st.booleans()
    | st.binary(max_size=16)
    | st.binary(min_size=OUT_OF_BAND_MIN_BYTES, max_size=OUT_OF_BAND_MIN_BYTES + 8)
    | st.just(Colour.RED)
    | st.text(max_size=4).map(Name)
)
values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=4).map(tuple)
        | children.map(lambda child: [*range(LIFT_MAX_ITEMS), child])  # too long to look in
        | st.dictionaries(st.text(max_size=4), children, max_size=4)
        | st.dictionaries(st.integers(), children, max_size=2)
    ),
    max_leaves=10,
)


def lifted(value: Any, depth: int = LIFT_DEPTH) -> set[int]:
    """The ids of the large bytes of `value` that must travel out of band."""
    kind = type(value)
    if kind is bytes:
        return {id(value)} if len(value) >= OUT_OF_BAND_MIN_BYTES else set()
    if depth == 0 or kind not in (tuple, list, dict) or len(value) > LIFT_MAX_ITEMS:
        return set()
    items = value.values() if kind is dict else value
    return set().union(*(lifted(item, depth - 1) for item in items))


def assert_same(got: Any, want: Any) -> None:
    assert type(got) is type(want), f"{got!r} arrived as a {type(got)}, not a {type(want)}"
    if type(want) is dict:
        assert list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
    elif type(want) in (list, tuple):
        assert len(got) == len(want)
        for got_item, want_item in zip(got, want, strict=True):
            assert_same(got_item, want_item)
    else:
        assert got == want


@settings(max_examples=120, deadline=None)
@given(values, values)
def test_builtin_values_travel_as_the_general_path_sends_them(args: Any, result: Any) -> None:
    """A call's (args, kwargs) and a result: large bytes within reach go out of band, one
    buffer each, and every value comes back of its own type."""
    for value in ((tuple(args) if type(args) is list else (args,), {"k": result}), result):
        payload = Payload.dump(value)
        shown = reprlib.repr(value)
        assert len(payload.buffers) == len(lifted(value)), f"large bytes in band: {shown}"
        assert_same(Payload(payload.body, payload.buffers).load(), value)


@settings(max_examples=150, deadline=None)
@given(st.lists(values, max_size=LIFT_MAX_ITEMS + 2), st.dictionaries(st.text(max_size=4), values))
def test_a_calls_arguments_are_dumped_as_their_tuple_would_be(
    args: list[Any], kwargs: dict[str, Any]
) -> None:
    """`dump_arguments`, which checks the arguments' plainness inline, sends the very bytes
    and buffers `Payload.dump((args, kwargs))` sends, for any mix (long ones included)."""
    got, want = dump_arguments(tuple(args), kwargs), Payload.dump((tuple(args), kwargs))
    assert bytes(got.body) == bytes(want.body), reprlib.repr((args, kwargs))
    assert [bytes(b) for b in got.buffers] == [bytes(b) for b in want.buffers]


@settings(max_examples=150, deadline=None)
@given(values)
def test_a_result_is_dumped_as_payload_dump_would(value: Any) -> None:
    """`dump_value`, which checks a result's plainness inline, sends the very bytes and
    buffers `Payload.dump(value)` sends, for any value."""
    got, want = dump_value(value), Payload.dump(value)
    assert bytes(got.body) == bytes(want.body), reprlib.repr(value)
    assert [bytes(b) for b in got.buffers] == [bytes(b) for b in want.buffers]
