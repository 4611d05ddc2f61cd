"""Slicing algebra (Region / Extent / Point / ValueMesh) against a plain nested-list model."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import actors
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh import Extent, Point, ValueMesh
from mesh.testing import Region

LABELS = ("a", "b", "c", "d", "e")
T = 30


# -- the reference model ------------------------------------------------------------------------


@dataclass
class Model:
    """A region as nested Python lists of base ranks, one nesting level per dimension."""

    labels: list[str]
    nested: Any  # an int when there are no dimensions

    @classmethod
    def full(cls, labels: list[str], sizes: list[int]) -> Model:
        def build(depth: int, offset: int) -> Any:
            if depth == len(sizes):
                return offset
            stride = math.prod(sizes[depth + 1 :])
            return [build(depth + 1, offset + i * stride) for i in range(sizes[depth])]

        return cls(list(labels), build(0, 0))

    @property
    def sizes(self) -> list[int]:
        sizes, level = [], self.nested
        for _ in self.labels:
            sizes.append(len(level))
            level = level[0] if level else None
        return sizes

    def ranks(self) -> list[int]:
        def flat(level: Any, depth: int) -> list[int]:
            if depth == len(self.labels):
                return [level]
            return [r for sub in level for r in flat(sub, depth + 1)]

        return flat(self.nested, 0)

    def slice(self, selection: dict[str, Any]) -> Model:
        for label in selection:
            if label not in self.labels:
                raise ValueError(f"unknown label {label}")
        sizes = self.sizes
        # Validate every selector, in dimension order, before applying any of them.
        chosen: list[list[int]] = []
        for label, size in zip(self.labels, sizes):
            selector = selection.get(label, slice(None))
            if isinstance(selector, bool) or not isinstance(selector, (int, slice)):
                raise TypeError(f"bad selector {selector!r}")
            if isinstance(selector, slice):
                chosen.append(list(range(size))[selector])  # ValueError for a zero step
            else:
                if not -size <= selector < size:
                    raise IndexError(selector)
                chosen.append([selector % size])
        if any(not c for c in chosen):
            raise ValueError("empty selection")

        def apply(level: Any, depth: int) -> Any:
            if depth == len(self.labels):
                return level
            label = self.labels[depth]
            if isinstance(selection.get(label), int):
                return apply(level[chosen[depth][0]], depth + 1)
            return [apply(level[i], depth + 1) for i in chosen[depth]]

        labels = [lb for lb in self.labels if not isinstance(selection.get(lb), int)]
        return Model(labels, apply(self.nested, 0))

    def flatten(self, name: str) -> Model:
        return Model([name], self.ranks())

    def rename(self, names: dict[str, str]) -> Model:
        for label in names:
            if label not in self.labels:
                raise ValueError(f"unknown label {label}")
        labels = [names.get(lb, lb) for lb in self.labels]
        if len(set(labels)) != len(labels):
            raise ValueError("duplicate labels")
        return Model(labels, self.nested)


def assert_matches(region: Region, model: Model) -> None:
    assert list(region.extent.labels) == model.labels
    assert list(region.extent.sizes) == model.sizes
    assert list(region.ranks) == model.ranks()
    assert len(region) == len(model.ranks()) == region.extent.nelements


# -- strategies ---------------------------------------------------------------------------------

small_ints = st.integers(-5, 5)
slices = st.builds(
    slice, st.none() | small_ints, st.none() | small_ints, st.none() | st.integers(-3, 3)
)
bad_selectors = st.sampled_from([True, False, "0", 1.0, None, (0,), [1]])
selectors = st.one_of(small_ints, slices, slices, bad_selectors)


@st.composite
def extents(draw: Any) -> tuple[list[str], list[int]]:
    ndims = draw(st.integers(1, 3))
    labels = draw(st.lists(st.sampled_from(LABELS), min_size=ndims, max_size=ndims, unique=True))
    sizes = draw(st.lists(st.integers(1, 4), min_size=ndims, max_size=ndims))
    return labels, sizes


def draw_op(data: Any, model: Model) -> tuple[str, dict[str, Any] | str]:
    labels, sizes = model.labels, dict(zip(model.labels, model.sizes))
    kind = data.draw(st.sampled_from(["slice", "slice", "slice", "flatten", "rename"]))
    if kind == "flatten":
        return kind, data.draw(st.sampled_from(LABELS))
    if kind == "rename":
        olds = data.draw(st.lists(st.sampled_from([*labels, "zz"]), unique=True, max_size=3))
        return kind, {old: data.draw(st.sampled_from(LABELS)) for old in olds}
    chosen = data.draw(
        st.lists(st.sampled_from([*labels, "zz"]), unique=True, max_size=len(labels) + 1)
    )
    valid_only = data.draw(st.booleans())
    selection = {}
    for label in chosen:
        size = sizes.get(label, 1)
        near = st.integers(-size - 1, size)  # every index plus one past each end
        bounds = st.none() | st.integers(-size - 2, size + 2)
        sliced = st.builds(slice, bounds, bounds, st.none() | st.integers(-3, 3))
        pick = st.one_of(near, sliced) if valid_only else st.one_of(near, sliced, selectors)
        selection[label] = data.draw(pick)
    return kind, selection


def run_op(target: Any, op: tuple[str, Any], is_model: bool) -> Any:
    kind, arg = op
    if kind == "slice":
        return target.slice(arg) if is_model else target.slice(**arg)
    if kind == "flatten":
        return target.flatten(arg)
    return target.rename(arg) if is_model else target.rename(**arg)


# -- properties ---------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(extents(), st.data())
def test_region_operations_match_the_model(extent: Any, data: Any) -> None:
    labels, sizes = extent
    region = Region.full(Extent(tuple(labels), tuple(sizes)))
    model = Model.full(labels, sizes)
    assert_matches(region, model)
    for _ in range(data.draw(st.integers(1, 4))):
        op = draw_op(data, model)
        try:
            expected = run_op(model, op, is_model=True)
        except (ValueError, TypeError, IndexError) as exc:
            with pytest.raises(type(exc)):
                run_op(region, op, is_model=False)
            return
        region = run_op(region, op, is_model=False)
        model = expected
        assert_matches(region, model)


@settings(max_examples=200, deadline=None)
@given(extents(), st.data())
def test_valid_slices_select_exactly_the_matching_coordinates(extent: Any, data: Any) -> None:
    """An independent check by coordinates: every base point whose coordinates pass the
    selection is in the slice, in row-major order of the new coordinates."""
    labels, sizes = extent
    selection = {}
    for label, size in zip(labels, sizes):
        if data.draw(st.booleans()):
            if data.draw(st.booleans()):
                selection[label] = data.draw(st.integers(-size, size - 1))
            else:
                selection[label] = data.draw(
                    st.builds(
                        slice,
                        st.none() | small_ints,
                        st.none() | small_ints,
                        st.sampled_from([None, 1, 2, -1, -2]),
                    )
                )
    index_lists = []
    for label, size in zip(labels, sizes):
        sel = selection.get(label, slice(None))
        index_lists.append([sel % size] if isinstance(sel, int) else list(range(size))[sel])
    region = Region.full(Extent(tuple(labels), tuple(sizes)))
    if any(not idx for idx in index_lists):
        with pytest.raises(ValueError, match="selects no ranks"):
            region.slice(**selection)
        return
    sliced = region.slice(**selection)
    expected = []
    for coords in itertools.product(*index_lists):
        rank = 0
        for c, size in zip(coords, sizes):
            rank = rank * size + c
        expected.append(rank)
    assert list(sliced.ranks) == expected
    kept = [lb for lb in labels if not isinstance(selection.get(lb), int)]
    assert list(sliced.extent.labels) == kept


@settings(max_examples=200, deadline=None)
@given(extents())
def test_point_rank_and_extent_point_are_inverse(extent: Any) -> None:
    labels, sizes = extent
    ext = Extent(tuple(labels), tuple(sizes))
    coords = list(itertools.product(*(range(s) for s in sizes)))  # row-major
    assert ext.nelements == len(coords)
    points = list(ext.points())
    assert len(points) == len(coords)
    for rank, (point, want) in enumerate(zip(points, coords)):
        assert isinstance(point, Point)
        assert point.rank == rank
        assert ext.point(rank) == point
        assert tuple(point[lb] for lb in labels) == want
        assert dict(point) == dict(zip(labels, want))
        assert list(point) == labels and len(point) == len(labels)
        assert point.extent == ext
    for bad in (-1, ext.nelements):
        with pytest.raises(IndexError):
            ext.point(bad)
    with pytest.raises(KeyError):
        points[0]["zz"]


@settings(max_examples=200, deadline=None)
@given(extents(), st.data())
def test_value_mesh_item_values_and_iteration(extent: Any, data: Any) -> None:
    labels, sizes = extent
    ext = Extent(tuple(labels), tuple(sizes))
    values = [f"v{i}" for i in range(ext.nelements)]
    vm = ValueMesh(ext, values)
    assert len(vm) == ext.nelements
    assert vm.values() == tuple(values)
    pairs = list(vm)
    assert [p.rank for p, _ in pairs] == list(range(ext.nelements))
    assert [v for _, v in pairs] == values
    for coords in itertools.product(*(range(s) for s in sizes)):
        rank = 0
        for c, s in zip(coords, sizes):
            rank = rank * s + c
        assert vm.item(**dict(zip(labels, coords))) == values[rank]
    label = data.draw(st.sampled_from(labels))
    coords = {lb: 0 for lb in labels}
    with pytest.raises(IndexError):
        vm.item(**{**coords, label: ext[label]})
    with pytest.raises(ValueError):
        vm.item(**{lb: 0 for lb in labels[1:]})
    with pytest.raises(ValueError):
        vm.item(**coords, zz=0)
    with pytest.raises(ValueError):
        ValueMesh(ext, [*values, "extra"])


# -- extents ------------------------------------------------------------------------------------


def test_extent_validation() -> None:
    with pytest.raises(ValueError):
        Extent(("a", "b"), (1,))
    with pytest.raises(ValueError):
        Extent(("a", "a"), (1, 2))
    with pytest.raises(ValueError):
        Extent(("a",), (0,))
    ext = Extent.of({"hosts": 2, "gpus": 3})
    assert ext.labels == ("hosts", "gpus") and ext.sizes == (2, 3)
    assert ext["gpus"] == 3 and dict(ext) == {"hosts": 2, "gpus": 3} and len(ext) == 2
    assert ext.nelements == 6
    with pytest.raises(KeyError):
        ext["nope"]
    scalar = Extent((), ())
    assert scalar.nelements == 1 and dict(scalar.point(0)) == {} and scalar.point(0).rank == 0


def test_error_messages_name_the_problem() -> None:
    region = Region.full(Extent(("hosts", "gpus"), (2, 4)))
    with pytest.raises(ValueError, match=r"'nope'.*dimensions"):
        region.slice(nope=0)
    with pytest.raises(IndexError, match="index 4 is out of range for dimension 'gpus'"):
        region.slice(gpus=4)
    with pytest.raises(TypeError, match="'gpus' must be sliced by an int or a slice"):
        region.slice(gpus="1")
    with pytest.raises(ValueError, match="selects no ranks"):
        region.slice(gpus=slice(3, 1))
    with pytest.raises(ValueError, match="cannot rename 'x'"):
        region.rename(x="y")


def test_mesh_handle_slicing_api(procs: Any) -> None:
    """size/sizes/extent/len and the slicing methods on a real mesh handle."""
    echo = procs.spawn("echo", actors.Echo)
    assert echo.sizes == {"gpus": 2} and procs.sizes == {"gpus": 2}
    assert echo.size() == 2 and echo.size("gpus") == 2 and echo.size(["gpus"]) == 2
    assert len(echo) == 2 and echo.extent == Extent(("gpus",), (2,))
    with pytest.raises(ValueError, match="no dimension 'hosts'"):
        echo.size("hosts")
    assert echo.slice(gpus=1).sizes == {}
    assert len(echo.slice(gpus=1)) == 1
    assert echo.slice(gpus=slice(None, None, -1)).sizes == {"gpus": 2}
    assert echo.flatten("x").sizes == {"x": 2} and echo.rename(gpus="g").sizes == {"g": 2}
    with pytest.raises(IndexError):
        echo.slice(gpus=2)
    assert procs.slice(gpus=0).sizes == {}


# -- real processes -----------------------------------------------------------------------------


def test_calls_on_slices_see_coordinates_within_the_slice(make_procs: Any) -> None:
    procs = make_procs({"a": 2, "b": 2})
    who = procs.spawn("who", actors.WhoAmI)
    everyone = who.whoami.call().get(timeout=T)
    pids = {tuple(v["rank"].values()): v["pid"] for v in everyone.values()}
    assert [v["rank"] for v in everyone.values()] == [
        {"a": 0, "b": 0},
        {"a": 0, "b": 1},
        {"a": 1, "b": 0},
        {"a": 1, "b": 1},
    ]

    row = who.slice(a=1).whoami.call().get(timeout=T)
    assert [v["rank"] for v in row.values()] == [{"b": 0}, {"b": 1}]
    assert all(v["size"] == {"b": 2} for v in row.values())
    assert [v["pid"] for v in row.values()] == [pids[(1, 0)], pids[(1, 1)]]

    reversed_column = who.slice(a=slice(None, None, -1), b=0).whoami.call().get(timeout=T)
    assert [v["rank"] for v in reversed_column.values()] == [{"a": 0}, {"a": 1}]
    assert [v["pid"] for v in reversed_column.values()] == [pids[(1, 0)], pids[(0, 0)]]

    one = who.slice(a=0, b=-1).whoami.call_one().get(timeout=T)
    assert one["rank"] == {} and one["size"] == {} and one["pid"] == pids[(0, 1)]

    nested = who.slice(b=slice(1, 2)).slice(a=1).whoami.call_one().get(timeout=T)
    assert nested["rank"] == {"b": 0} and nested["size"] == {"b": 1}
    assert nested["pid"] == pids[(1, 1)]

    flat = who.slice(b=1).flatten("n").awhoami.call().get(timeout=T)
    assert [v["rank"] for v in flat.values()] == [{"n": 0}, {"n": 1}]
    # __init__ saw the point in the spawned mesh, whatever slice is called later.
    assert who.slice(a=1, b=0).init_info.call_one().get(timeout=T) == {
        "rank": {"a": 1, "b": 0},
        "size": {"a": 2, "b": 2},
    }
