"""`ValueMesh`: one value per point of the mesh a call was sent to."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from mesh._shape import Extent, Point

T = TypeVar("T")


class ValueMesh(Generic[T]):
    """Results of a `call`: iterating yields ``(Point, value)`` pairs in rank order."""

    def __init__(self, extent: Extent, values: Sequence[T]) -> None:
        if len(values) != extent.nelements:
            raise ValueError(
                f"a value mesh over {dict(extent)} needs {extent.nelements} values, "
                f"got {len(values)}"
            )
        self.extent = extent
        self._values = tuple(values)

    def __iter__(self) -> Iterator[tuple[Point, T]]:
        return zip(self.extent.points(), self._values)

    def values(self) -> tuple[T, ...]:
        """The values alone, in rank order."""
        return self._values

    def item(self, **coords: int) -> T:
        """The value at the point given by `coords` (every dimension must be named)."""
        if set(coords) != set(self.extent.labels):
            raise ValueError(
                f"item() needs exactly the coordinates {list(self.extent.labels)}, "
                f"got {list(coords)}"
            )
        rank = 0
        for label, size in zip(self.extent.labels, self.extent.sizes):
            index = coords[label]
            if not 0 <= index < size:
                raise IndexError(f"{label}={index} is out of range for size {size}")
            rank = rank * size + index
        return self._values[rank]

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        pairs = ", ".join(f"{dict(p)}: {v!r}" for p, v in list(self)[:8])
        more = ", ..." if len(self) > 8 else ""
        return f"ValueMesh({{{pairs}{more}}})"
