"""Whether a decoded message holds the types its class declares: `invalid_fields`.

Headers are decoded from whatever a peer sent, so a well-framed message may still carry a
list where a str belongs; receivers check before acting on it. Each field's check is built
once per class from its type hint, and a tuple of plain values is checked in one pass of C
(`map(type, ...)`): walking the hints anew for every value cost about 1,100 Python calls for
the header of a call fanned out to 32 procs, and 27 for each answer an agent relays.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable
from typing import Any

Check = Callable[[object], bool]

#: The types a plain hint accepts: exactly these (a bool is no int here), and an int as a float.
_PLAIN: dict[Any, frozenset[type]] = {
    int: frozenset({int}),
    str: frozenset({str}),
    bool: frozenset({bool}),
    bytes: frozenset({bytes}),
    float: frozenset({float, int}),
    type(None): frozenset({type(None)}),
}

_CHECKS: dict[type, tuple[tuple[str, Check, Any], ...]] = {}


def invalid_fields(header: object) -> str | None:
    """Why `header` (a decoded message) does not hold the types its class declares, or None."""
    for name, check, hint in _checks_of(type(header)):
        value = getattr(header, name, None)
        if not check(value):
            return (
                f"field {name!r} of {type(header).__name__} must be {_describe(hint)}, "
                f"not {type(value).__name__} {short_repr(value)}"
            )
    return None


def short_repr(value: object) -> str:
    """`repr(value)`, cut to 60 characters: for error messages about what a peer sent."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _checks_of(cls: type) -> tuple[tuple[str, Check, Any], ...]:
    """(name, check, hint) of each field of a dataclass (none for other classes), cached."""
    found = _CHECKS.get(cls)
    if found is None:
        found = ()
        if dataclasses.is_dataclass(cls):
            hints = typing.get_type_hints(cls)
            fields = dataclasses.fields(cls)
            found = tuple((f.name, _check_for(hints[f.name]), hints[f.name]) for f in fields)
        _CHECKS[cls] = found
    return found


def _plain_types(hint: Any) -> frozenset[type] | None:
    """The exact types `hint` accepts when it is plain or a union of plain hints, else None."""
    plain = _PLAIN.get(hint)
    if plain is not None:
        return plain
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [_plain_types(option) for option in typing.get_args(hint)]
        if all(option is not None for option in options):
            return frozenset().union(*options)  # type: ignore[arg-type]
    return None


def _check_for(hint: Any) -> Check:
    """``check(value)``: whether `value` is of type `hint` (nested messages checked too)."""
    plain = _plain_types(hint)
    if plain is not None:
        return lambda value: type(value) in plain
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        options = tuple(_check_for(option) for option in typing.get_args(hint))
        return lambda value: any(check(value) for check in options)
    if origin is tuple:
        return _tuple_check(typing.get_args(hint))
    if origin is frozenset:
        return _items_check(frozenset, typing.get_args(hint)[0])
    return lambda value: type(value) is hint and invalid_fields(value) is None


def _tuple_check(args: tuple[Any, ...]) -> Check:
    if len(args) == 2 and args[1] is Ellipsis:
        return _items_check(tuple, args[0])
    count, plain = len(args), [_plain_types(arg) for arg in args]
    if all(accepted is not None for accepted in plain):  # each item's type tested in C
        return lambda value: (
            type(value) is tuple
            and len(value) == count
            and all(map(frozenset.__contains__, plain, map(type, value)))  # type: ignore[arg-type]
        )
    checks = tuple(_check_for(arg) for arg in args)
    return lambda value: (
        type(value) is tuple and len(value) == count and all(map(_call, checks, value))  # type: ignore[arg-type]
    )


def _items_check(container: type, item: Any) -> Check:
    """The check of a `container` (tuple or frozenset) whose every item is an `item`."""
    plain = _plain_types(item)
    if plain is not None:  # every item's type tested in C
        return lambda value: type(value) is container and plain.issuperset(map(type, value))  # type: ignore[call-overload]
    check = _check_for(item)
    return lambda value: type(value) is container and all(map(check, value))  # type: ignore[call-overload]


def _call(function: Callable[[Any], bool], value: Any) -> bool:
    return function(value)


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) is None and hasattr(hint, "__name__"):
        return str(hint.__name__)
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+(\w+)", r"\1", str(hint))  # without module paths
