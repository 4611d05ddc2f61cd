"""Extents, points and regions: the coordinate algebra behind mesh slicing.

A `Region` is an extent (ordered labels with sizes) plus, in row-major order, the ranks of the
base mesh it selects. Slicing, flattening and renaming produce new regions; nothing is copied
but a tuple of ints.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar


@dataclass(frozen=True)
class Extent(Mapping[str, int]):
    """Ordered dimension labels with their sizes, e.g. ``Extent(("hosts", "gpus"), (2, 4))``."""

    labels: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.labels) != len(self.sizes):
            raise ValueError(
                f"an extent needs one size per label, got labels {self.labels} "
                f"and sizes {self.sizes}"
            )
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"extent labels must be unique, got {self.labels}")
        for label, size in zip(self.labels, self.sizes):
            if not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"dimension {label!r} must have a positive integer size, got {size!r}"
                )

    @classmethod
    def of(cls, sizes: Mapping[str, int]) -> Extent:
        return cls(tuple(sizes), tuple(sizes.values()))

    @property
    def nelements(self) -> int:
        return math.prod(self.sizes)

    def __getitem__(self, label: str) -> int:
        try:
            return self.sizes[self.labels.index(label)]
        except ValueError:
            raise KeyError(label) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.labels)

    def __len__(self) -> int:
        return len(self.labels)

    def point(self, rank: int) -> Point:
        """The point with row-major index `rank`."""
        if not 0 <= rank < self.nelements:
            raise IndexError(f"rank {rank} is outside an extent of {self.nelements} points")
        coords = []
        for size in reversed(self.sizes):
            rank, index = divmod(rank, size)
            coords.append(index)
        return Point(tuple(reversed(coords)), self)

    def points(self) -> Iterator[Point]:
        return (self.point(rank) for rank in range(self.nelements))

    def __repr__(self) -> str:
        return f"Extent({dict(zip(self.labels, self.sizes))})"


@dataclass(frozen=True)
class Point(Mapping[str, int]):
    """A position in an extent: a mapping label → index, with its row-major `rank`."""

    coords: tuple[int, ...]
    extent: Extent

    @property
    def rank(self) -> int:
        rank = 0
        for index, size in zip(self.coords, self.extent.sizes):
            rank = rank * size + index
        return rank

    def __getitem__(self, label: str) -> int:
        try:
            return self.coords[self.extent.labels.index(label)]
        except ValueError:
            raise KeyError(label) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.extent.labels)

    def __len__(self) -> int:
        return len(self.coords)

    def __repr__(self) -> str:
        return f"Point({dict(zip(self.extent.labels, self.coords))}, rank={self.rank})"


@dataclass(frozen=True)
class Region:
    """An extent and the base ranks it covers, in row-major order."""

    extent: Extent
    ranks: tuple[int, ...]

    @classmethod
    def full(cls, extent: Extent) -> Region:
        return cls(extent, tuple(range(extent.nelements)))

    def __len__(self) -> int:
        return len(self.ranks)

    def slice(self, **selection: int | slice) -> Region:
        """Select along named dimensions: an int drops the dimension, a slice keeps it."""
        unknown = [label for label in selection if label not in self.extent.labels]
        if unknown:
            raise ValueError(
                f"cannot slice by {', '.join(map(repr, unknown))}: the mesh has "
                f"dimensions {list(self.extent.labels)}"
            )
        picks: list[range] = []
        labels: list[str] = []
        sizes: list[int] = []
        for label, size in zip(self.extent.labels, self.extent.sizes):
            chosen = _select(label, size, selection.get(label, slice(None)))
            picks.append(chosen)
            if not isinstance(selection.get(label), int):
                labels.append(label)
                sizes.append(len(chosen))
        if any(len(pick) == 0 for pick in picks):
            raise ValueError(
                f"slice {selection} selects no ranks of a mesh with extent {dict(self.extent)}"
            )
        flat = Region.full(self.extent)  # maps coordinates to positions in self.ranks
        ranks = tuple(self.ranks[_position(flat.extent, c)] for c in itertools.product(*picks))
        return Region(Extent(tuple(labels), tuple(sizes)), ranks)

    def flatten(self, label: str) -> Region:
        """All dimensions folded into one called `label`."""
        return Region(Extent((label,), (len(self.ranks),)), self.ranks)

    def rename(self, **names: str) -> Region:
        """Dimensions renamed, ``old=new``."""
        unknown = [label for label in names if label not in self.extent.labels]
        if unknown:
            raise ValueError(
                f"cannot rename {', '.join(map(repr, unknown))}: the mesh has "
                f"dimensions {list(self.extent.labels)}"
            )
        labels = tuple(names.get(label, label) for label in self.extent.labels)
        return Region(Extent(labels, self.extent.sizes), self.ranks)


S = TypeVar("S", bound="Sliceable")


class Sliceable:
    """What meshes of hosts, procs and actors and value meshes share: an extent and array-like
    slicing over a `Region`, so a `ValueMesh` slices exactly as the mesh it came from."""

    _region: Region

    def _with_region(self: S, region: Region) -> S:
        raise NotImplementedError

    @property
    def extent(self) -> Extent:
        return self._region.extent

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self._region.extent)

    def size(self, dim: str | Iterable[str] | None = None) -> int:
        """Number of points along `dim` (a label or several), or in the whole mesh."""
        if dim is None:
            return len(self._region)
        labels = [dim] if isinstance(dim, str) else list(dim)
        total = 1
        for label in labels:
            if label not in self.extent.labels:
                raise ValueError(
                    f"mesh has no dimension {label!r}; its dimensions are "
                    f"{list(self.extent.labels)}"
                )
            total *= self.extent[label]
        return total

    def __len__(self) -> int:
        return len(self._region.ranks)

    def slice(self: S, **selection: int | slice) -> S:
        """A sub-mesh: an int drops that dimension, a slice keeps it."""
        return self._with_region(self._region.slice(**selection))

    def flatten(self: S, name: str) -> S:
        """The same points along a single dimension called `name`."""
        return self._with_region(self._region.flatten(name))

    def rename(self: S, **names: str) -> S:
        """The same mesh with dimensions renamed, ``old=new``."""
        return self._with_region(self._region.rename(**names))


def _select(label: str, size: int, selector: int | slice) -> range:
    if isinstance(selector, bool) or not isinstance(selector, (int, slice)):
        raise TypeError(
            f"dimension {label!r} must be sliced by an int or a slice, "
            f"got {type(selector).__name__} {selector!r}"
        )
    if isinstance(selector, slice):
        return range(size)[selector]
    index = selector + size if selector < 0 else selector
    if not 0 <= index < size:
        raise IndexError(f"index {selector} is out of range for dimension {label!r} of size {size}")
    return range(index, index + 1)


def _position(extent: Extent, coords: tuple[int, ...]) -> int:
    rank = 0
    for index, size in zip(coords, extent.sizes):
        rank = rank * size + index
    return rank
