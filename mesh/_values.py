"""`ValueMesh`: one value per point of the mesh a call was sent to."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

from mesh._shape import Extent, Point, Region, Sliceable

T = TypeVar("T")


class ValueMesh(Sliceable, Generic[T]):
    """Results of a `call`: iterating (or `items()`) yields ``(Point, value)`` pairs in rank
    order. It slices, flattens and renames as the mesh it came from does (the same `Region`
    algebra), so ``vm.slice(**s)`` holds the values that ``actors.slice(**s)`` would answer."""

    def __init__(self, extent: Extent, values: Sequence[T]) -> None:
        if len(values) != extent.nelements:
            raise ValueError(
                f"a value mesh over {dict(extent)} needs {extent.nelements} values, "
                f"got {len(values)}"
            )
        self._region = Region.full(extent)
        self._values = tuple(values)

    def _with_region(self, region: Region) -> ValueMesh[T]:
        return ValueMesh(region.extent, [self._values[rank] for rank in region.ranks])

    def __iter__(self) -> Iterator[tuple[Point, T]]:
        return zip(self.extent.points(), self._values)

    def items(self) -> Iterator[tuple[Point, T]]:
        """``(Point, value)`` pairs in rank order, points within this mesh (as iteration)."""
        return iter(self)

    def values(self) -> tuple[T, ...]:
        """The values alone, in rank order."""
        return self._values

    def item(self, **coords: int) -> T:
        """The value at the point given by `coords` (every dimension must be named; none for a
        mesh of one point, such as a slice down to one actor)."""
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

    def __repr__(self) -> str:
        pairs = ", ".join(f"{dict(p)}: {v!r}" for p, v in list(self)[:8])
        more = ", ..." if len(self) > 8 else ""
        return f"ValueMesh({{{pairs}{more}}})"
