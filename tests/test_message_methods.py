"""Message types declared with ``repr=False, eq=False`` (cheaper to create: nothing compiled)
get equality, hashing and repr from their fields (`transport.message_type`), the same as
the dataclass would have made them; methods a type has of its own stay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from transport import decode, encode, message_type

VALUES = st.integers() | st.text(max_size=8) | st.none() | st.tuples(st.integers())


@message_type
@dataclass(frozen=True, slots=True)
class Compiled:
    """Its methods made by the dataclass."""

    number: Any
    name: Any


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class Filled:
    """Its methods filled in from its fields."""

    number: Any
    name: Any


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class One:
    """A single field."""

    value: Any


@message_type
@dataclass(frozen=True, slots=True, repr=False, eq=False)
class OwnRepr:
    """A repr of its own."""

    value: int

    def __repr__(self) -> str:
        return "mine"


@given(a=st.tuples(VALUES, VALUES), b=st.tuples(VALUES, VALUES))
def test_filled_in_methods_behave_as_the_dataclass_ones(
    a: tuple[Any, Any], b: tuple[Any, Any]
) -> None:
    compiled_a, compiled_b, filled_a, filled_b = Compiled(*a), Compiled(*b), Filled(*a), Filled(*b)
    assert (filled_a == filled_b) == (compiled_a == compiled_b)
    assert (filled_a != filled_b) == (compiled_a != compiled_b)
    assert hash(filled_a) == hash(compiled_a)
    assert repr(filled_a) == repr(compiled_a).replace("Compiled(", "Filled(", 1)
    assert filled_a != compiled_a  # another type, even with the same fields


@given(value=VALUES)
def test_a_single_field_message_compares_hashes_and_shows_its_field(value: Any) -> None:
    assert One(value) == One(value) and hash(One(value)) == hash((value,))
    assert repr(One(value)) == f"One(value={value!r})"


@given(value=st.integers(), name=st.text(max_size=8))
def test_a_filled_in_message_survives_the_wire(value: int, name: str) -> None:
    sent = Filled(value, name)
    received = decode(encode(sent)).header
    assert received == sent and hash(received) == hash(sent)


def test_a_method_of_its_own_stays() -> None:
    assert repr(OwnRepr(3)) == "mine"
    assert OwnRepr(3) == OwnRepr(3)
