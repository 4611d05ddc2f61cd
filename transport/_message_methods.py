"""Equality, hashing and repr for message types declared without them.

A frozen dataclass compiles its ``__eq__``, ``__hash__`` and ``__repr__`` from source text
when its class is made: for the eighty-odd message types, about a third of what importing
them costs, paid by every agent and proc at start (and so by a client's first spawn). A
message type declared with ``repr=False, eq=False`` gets the same methods from its fields here
instead (`message_type` fills them in), with nothing to compile.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any


def fill_in_methods(cls: type, names: tuple[str, ...]) -> None:
    """Give `cls` (fields `names`) the dataclass ``__eq__``, ``__hash__`` and ``__repr__``
    it was declared without; methods it has of its own stay."""
    values = _values_getter(names)
    if "__eq__" not in cls.__dict__:

        def __eq__(self: Any, other: Any) -> Any:
            if other.__class__ is self.__class__:
                return values(self) == values(other)
            return NotImplemented

        def __hash__(self: Any) -> int:
            return hash(values(self))

        cls.__eq__ = __eq__  # type: ignore[method-assign,assignment]
        cls.__hash__ = __hash__  # type: ignore[method-assign,assignment]
    if "__repr__" not in cls.__dict__:

        def __repr__(self: Any) -> str:
            shown = ", ".join(f"{name}={value!r}" for name, value in zip(names, values(self)))
            return f"{self.__class__.__qualname__}({shown})"

        cls.__repr__ = __repr__  # type: ignore[method-assign,assignment]


def _values_getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """The tuple of a message's field values, in order."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    if names:
        one = operator.attrgetter(names[0])
        return lambda message: (one(message),)
    return lambda message: ()
