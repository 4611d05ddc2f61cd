"""The scan that makes ``marshal.loads`` safe on a received header (see `_frames`).

Before marshal reads a header, this rejects every marshal type outside the plain values a
header may hold (code objects included) and every declared length or item count larger than
the bytes left, so reading it can neither run code nor allocate without bound.
"""

from __future__ import annotations

import struct

from ._errors import MalformedMessage

# How the scan treats each marshal type code (with or without the FLAG_REF bit 0x80):
# > 0: a token of that many bytes; _SHORT: a string with a one-byte length; _SIZED: a
# string with a four-byte length; _COUNTED: a container with a four-byte item count; _LONG:
# an int with a four-byte digit count; 0: a type a header never holds (code, complex...).
_SHORT, _SIZED, _COUNTED, _LONG = -1, -2, -3, -4
_I32 = struct.Struct("<i")


def _token_table() -> tuple[int, ...]:
    table = [0] * 256
    kinds = {"0NFT.{": 1, "ir": 5, "g": 9, ")": 2, "zZ": _SHORT}
    kinds |= {"stuaA": _SIZED, "([<>": _COUNTED, "l": _LONG}
    for codes, kind in kinds.items():
        for code in codes:
            table[ord(code)] = table[ord(code) | 0x80] = kind
    return tuple(table)


_TOKENS = _token_table()


def check_marshal(data: bytes | memoryview) -> None:
    """Raise MalformedMessage unless `data` is marshal of plain values whose declared sizes
    fit in `data` (so that ``marshal.loads`` runs no code and allocates within bounds)."""
    position, end, table = 0, len(data), _TOKENS
    while position < end:
        step = table[data[position]]
        if step > 0:
            position += step
        elif step == _SHORT:
            position += 2 + data[position + 1] if position + 1 < end else 2
        else:
            position = _sized_token(data, position, step, end)
    if position != end:
        raise MalformedMessage("a truncated header: its last value runs past its end")


def _sized_token(data: bytes | memoryview, position: int, kind: int, end: int) -> int:
    """Where the token at `position` ends (its items follow it, for a container)."""
    if kind == 0:
        raise MalformedMessage(
            f"a header holds marshal type {chr(data[position] & 0x7F)!r}, which is not a plain "
            "value a header may hold"
        )
    if position + 5 > end:
        raise MalformedMessage("a truncated header: a length runs past its end")
    (count,) = _I32.unpack_from(data, position + 1)
    position += 5
    size = 2 * abs(count) if kind == _LONG else count
    if size < 0 or size > end - position:
        raise MalformedMessage(
            f"a header declares {count} items or bytes, more than its {end - position} "
            "remaining bytes could hold"
        )
    return position if kind == _COUNTED else position + size
