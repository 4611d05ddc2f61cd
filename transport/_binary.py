"""Binary headers: the hot messages (a call, its reply) packed with `struct`, not marshal.

A binary header has no marshal scan to pass and no tuple of names to build. Its leading int
fields (the call id, different in every message, and any other int that changes from message
to message, declared right after it) are packed afresh each time; the rest of a call's header
(reply address, actor, endpoint, mesh labels and sizes, rank) is the same for every call to
one actor's endpoint, so each side encodes or decodes it once and keeps it. Layout, after the
frame prefix whose codec byte names the message type (see `_frames`)::

    the first field            int64 little-endian
    then each other field, in the order the class declares them:
        int                    int64 little-endian
        str                    u32 length + its UTF-8 bytes
        str | None             the same, length 0xFFFFFFFF for None (no bytes follow)
        tuple[str, ...]        u32 count + count times (u32 length + UTF-8 bytes)
        tuple[int, ...]        u32 count + count times int64

Decoding runs no code and allocates at most about the size of the frame: every length and
count is checked against the bytes left before anything is read, and bytes that do not fit
the layout (a length past the end, bad UTF-8, bytes left over) raise MalformedMessage.
"""

from __future__ import annotations

import operator
import struct
from collections import deque
from collections.abc import Callable
from itertools import repeat as _repeat
from typing import Any

from ._errors import MalformedMessage

_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_NONE = 0xFFFFFFFF
_new = object.__new__
_call = operator.call
_drain: Callable[[Any], None] = deque(maxlen=0).extend  # runs an iterator to its end, in C
#: The declared type of a field (as written in its class) → its kind in a layout.
_KINDS = {
    "int": "i",
    "str": "s",
    "str | None": "z",
    "tuple[str, ...]": "S",
    "tuple[int, ...]": "I",
}
#: Distinct variable parts each layout keeps encoded (and decoded) before starting afresh...
_CACHED = 1024
#: ... each of at most this many bytes (a call's is about a hundred), so they hold < 1 MiB.
_CACHED_BYTES = 512


def layout_kinds(cls: type, types: tuple[str, ...]) -> str:
    """One kind letter per field of `cls` (whose declared types are `types`); TypeError for
    a type a binary header cannot hold."""
    kinds = []
    for declared in types:
        kind = _KINDS.get(declared.replace("Optional[str]", "str | None"))
        if kind is None:
            raise TypeError(
                f"{cls.__qualname__} cannot have a binary header: a field of type {declared} "
                f"is none of {', '.join(_KINDS)}"
            )
        kinds.append(kind)
    return "".join(kinds)


class BinaryLayout:
    """Encodes and decodes the fields of one message type (see the module's docstring)."""

    def __init__(
        self,
        cls: type,
        names: tuple[str, ...],
        kinds: str,
        setters: tuple[Callable[[Any, Any], None], ...] | None,
    ) -> None:
        """The layout of `cls` messages, whose fields `names` are of `kinds`; `decode_message`
        builds one through its slot `setters` (one per field, in order), or by calling `cls`
        with the fields when None."""
        name = cls.__name__
        if kinds[:1] != "i":
            raise TypeError(f"{name} cannot have a binary header: its first field is no int")
        self.name, self._names, self._kinds = name, names, kinds
        self._cls, self._setters = cls, setters
        self._ints = struct.Struct("<" + "q" * len(kinds)) if set(kinds) == {"i"} else None
        self.lead = len(kinds) - len(kinds.lstrip("i"))  # leading ints: never kept
        self._head = struct.Struct("<" + "q" * self.lead)
        # a value equal to a kept one (True for 1) is sent as the kept one: of declared type
        self._encoded: dict[tuple[Any, ...], bytes] = {}
        self._decoded: dict[bytes, tuple[Any, ...]] = {}

    def encode(self, values: tuple[Any, ...]) -> bytes | None:
        """The header of a message whose fields are `values`; None when one of them is not
        of its declared type (the caller then uses another encoding)."""
        try:
            if self._ints is not None:  # a reply: ints only
                for value in values:
                    if type(value) is not int:
                        return None
                return self._ints.pack(*values)
            lead = self.lead
            for value in values[:lead]:
                if type(value) is not int:
                    return None
            rest = values[lead:]
            tail = self._encoded.get(rest)
            if tail is None:
                tail = self.encode_rest(rest, lead)
                if tail is None:
                    return None
                if len(tail) <= _CACHED_BYTES:
                    if len(self._encoded) >= _CACHED:
                        self._encoded.clear()
                    self._encoded[rest] = tail
            return self._head.pack(*values[:lead]) + tail
        except (struct.error, TypeError):  # an int past 64 bits; a value that is unhashable
            return None

    def encode_rest(self, rest: tuple[Any, ...], start: int = 1) -> bytes | None:
        """The fields from position `start` on (`rest`), encoded; None when one is not of its
        declared type."""
        parts: list[bytes] = []
        for kind, value in zip(self._kinds[start:], rest, strict=True):
            if kind == "i":
                if type(value) is not int:
                    return None
                parts.append(_I64.pack(value))
            elif kind == "z" and value is None:
                parts.append(_U32.pack(_NONE))
            elif kind in "sz":
                if type(value) is not str or not _encode_str(value, parts):
                    return None
            elif type(value) is not tuple:
                return None
            elif kind == "S":
                parts.append(_U32.pack(len(value)))
                if not all(type(v) is str and _encode_str(v, parts) for v in value):
                    return None
            else:
                if not all(type(v) is int for v in value):
                    return None
                parts.append(struct.pack(f"<I{len(value)}q", len(value), *value))
        return b"".join(parts)

    def decode_message(self, frame: memoryview, start: int, end: int) -> Any:
        """The message whose header is ``frame[start:end]``, unpacked where it lies and built
        in the same call (every call and reply received pays this); MalformedMessage if the
        header does not follow this layout."""
        ints = self._ints
        if ints is not None:  # a reply: ints only
            if end - start != ints.size:
                raise MalformedMessage(
                    f"a {self.name} header of {end - start} bytes: it holds {ints.size}"
                )
            values = ints.unpack_from(frame, start)
        else:
            head = self._head
            if end - start < head.size:
                raise MalformedMessage(
                    f"a truncated {self.name} header: {end - start} bytes, fewer than its "
                    "leading ints"
                )
            tail = bytes(frame[start + head.size : end])
            rest = self._decoded.get(tail)
            if rest is None:
                rest = self._read_rest(tail)
            values = head.unpack_from(frame, start) + rest
        setters = self._setters
        if setters is None:
            return self._cls(*values)
        message: Any = _new(self._cls)
        # each `setter(message, value)`, called from C: no bytecode per field
        _drain(map(_call, setters, _repeat(message, len(values)), values))
        return message

    def build(self, values: tuple[Any, ...]) -> Any:
        """The message whose fields are `values` (as read: of their declared types), built
        as `decode_message` builds it."""
        setters = self._setters
        if setters is None:
            return self._cls(*values)
        message: Any = _new(self._cls)
        _drain(map(_call, setters, _repeat(message, len(values)), values))
        return message

    def _read_rest(self, tail: bytes) -> tuple[Any, ...]:
        """The fields after the leading ints, read from `tail` and kept (small ones)."""
        rest = _Reader(self, tail).fields()
        if len(tail) <= _CACHED_BYTES:
            if len(self._decoded) >= _CACHED:
                self._decoded.clear()
            self._decoded[tail] = rest
        return rest

    def field_name(self, position: int) -> str:
        return self._names[position]

    def kind(self, position: int) -> str:
        return self._kinds[position]

    @property
    def count(self) -> int:
        return len(self._kinds)

    @property
    def ints_only(self) -> bool:
        """Whether every field is an int (a reply): the header is one fixed-size struct."""
        return self._ints is not None


def _encode_str(value: str, parts: list[bytes]) -> bool:
    """Append `value` (length, UTF-8); False if it cannot be UTF-8 (a lone surrogate)."""
    try:
        data = value.encode()
    except UnicodeEncodeError:
        return False
    parts.append(_U32.pack(len(data)))
    parts.append(data)
    return True


class _Reader:
    """Reads the non-int fields of a binary header, checking each length before using it."""

    def __init__(self, layout: BinaryLayout, data: bytes) -> None:
        self._layout, self._data, self._at = layout, data, 0
        self._field = ""

    def fields(self) -> tuple[Any, ...]:
        values = []
        layout = self._layout
        for position in range(layout.lead, layout.count):
            self._field = layout.field_name(position)
            values.append(self._value(layout.kind(position)))
        if self._at != len(self._data):
            raise MalformedMessage(
                f"a {layout.name} header holds {len(self._data) - self._at} bytes after its "
                "last field"
            )
        return tuple(values)

    def _value(self, kind: str) -> Any:
        if kind == "i":
            self._fits(8, "an int")
            (value,) = _I64.unpack_from(self._data, self._at)
            self._at += 8
            return value
        if kind == "s":
            return self._str(self._u32())
        if kind == "z":
            length = self._u32()
            return None if length == _NONE else self._str(length)
        count = self._u32()
        if kind == "S":
            self._fits(4 * count, f"{count} strings")
            return tuple(self._str(self._u32()) for _ in range(count))
        self._fits(8 * count, f"{count} ints")
        values = struct.unpack_from(f"<{count}q", self._data, self._at)
        self._at += 8 * count
        return values

    def _u32(self) -> int:
        self._fits(4, "a length")
        (value,) = _U32.unpack_from(self._data, self._at)
        self._at += 4
        return int(value)

    def _str(self, length: int) -> str:
        self._fits(length, f"a string of {length} bytes")
        start = self._at
        self._at += length
        try:
            return self._data[start : self._at].decode()
        except UnicodeDecodeError as exc:
            raise MalformedMessage(
                f"field {self._field!r} of a {self._layout.name} header is not UTF-8: {exc}"
            ) from None

    def _fits(self, size: int, what: str) -> None:
        if size > len(self._data) - self._at:
            raise MalformedMessage(
                f"a truncated {self._layout.name} header: field {self._field!r} declares "
                f"{what}, more than its {len(self._data) - self._at} remaining bytes hold"
            )
