"""ValueMesh operations (`items`, `slice`, `flatten`, `rename`, `size`): consistent with the
meshes they come from, checked against real actor calls and as properties for all extents."""

from __future__ import annotations

from typing import Any

import actors
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh import Extent, Point, ValueMesh
from mesh.testing import Region

LABELS = ("a", "b", "c")
T = 30


@st.composite
def value_meshes(draw: Any) -> ValueMesh[int]:
    ndims = draw(st.integers(0, 3))
    labels = tuple(LABELS[:ndims])
    sizes = tuple(draw(st.lists(st.integers(1, 4), min_size=ndims, max_size=ndims)))
    extent = Extent(labels, sizes)
    return ValueMesh(extent, [100 + i for i in range(extent.nelements)])


@st.composite
def selections(draw: Any, sizes: dict[str, int]) -> dict[str, int | slice]:
    """A valid selection of some dimensions: an index or a non-empty slice of each."""
    chosen: dict[str, int | slice] = {}
    for label, size in sizes.items():
        kind = draw(st.sampled_from(["keep", "index", "slice"]))
        if kind == "index":
            chosen[label] = draw(st.integers(-size, size - 1))
        elif kind == "slice":
            start = draw(st.integers(0, size - 1))
            step = draw(st.sampled_from([1, 2, -1]))
            chosen[label] = slice(start, None, step)
    return chosen


@settings(max_examples=200, deadline=None)
@given(value_meshes(), st.data())
def test_slicing_a_value_mesh_picks_the_values_the_region_picks(
    vm: ValueMesh[int], data: Any
) -> None:
    selection = data.draw(selections(vm.sizes))
    region = Region.full(vm.extent).slice(**selection)
    sliced = vm.slice(**selection)
    assert sliced.extent == region.extent
    assert sliced.values() == tuple(vm.values()[rank] for rank in region.ranks)
    assert len(sliced) == len(region) == sliced.size()
    for point, value in sliced.items():
        assert sliced.item(**point) == value


@settings(max_examples=200, deadline=None)
@given(value_meshes(), st.sampled_from(["rank", "a", "flat"]))
def test_flatten_keeps_order_and_size(vm: ValueMesh[int], name: str) -> None:
    flat = vm.flatten(name)
    assert flat.sizes == {name: len(vm)}
    assert flat.values() == vm.values()
    assert [point[name] for point, _ in flat.items()] == list(range(len(vm)))


@settings(max_examples=200, deadline=None)
@given(value_meshes())
def test_items_agree_with_iteration(vm: ValueMesh[int]) -> None:
    pairs = list(vm.items())
    assert pairs == list(vm)
    assert [value for _, value in pairs] == list(vm.values())
    assert all(isinstance(point, Point) and point.extent == vm.extent for point, _ in pairs)
    assert [point.rank for point, _ in pairs] == list(range(len(vm)))


def test_rename_size_and_errors() -> None:
    vm = ValueMesh(Extent(("hosts", "gpus"), (2, 3)), list(range(6)))
    assert vm.rename(gpus="g").sizes == {"hosts": 2, "g": 3}
    assert vm.rename(gpus="g").values() == vm.values()
    assert vm.size("gpus") == 3 and vm.size(["hosts", "gpus"]) == 6
    assert vm.slice(hosts=1, gpus=2).item() == 5  # a single point: item() takes no coordinates
    with pytest.raises(ValueError, match=r"'nope'.*dimensions"):
        vm.slice(nope=0)
    with pytest.raises(IndexError, match="out of range for dimension 'gpus'"):
        vm.slice(gpus=3)
    with pytest.raises(ValueError, match="selects no ranks"):
        vm.slice(gpus=slice(2, 1))
    with pytest.raises(ValueError, match="no dimension 'nope'"):
        vm.size("nope")


@pytest.fixture
def who(make_procs: Any) -> Any:
    """WhoAmI actors on a real {a: 2, b: 3} proc mesh."""
    return make_procs({"a": 2, "b": 3}).spawn("who", actors.WhoAmI)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.data())
def test_slicing_a_value_mesh_agrees_with_slicing_the_mesh(who: Any, data: Any) -> None:
    """The values of ``call()`` sliced are what a call on the sliced actor mesh answers
    (the same actors, at the same points), also after flattening both."""
    everyone = who.whoami.call().get(timeout=T)
    selection = data.draw(selections(who.sizes))
    from_values = everyone.slice(**selection)
    from_mesh = who.slice(**selection).whoami.call().get(timeout=T)
    assert from_values.extent == from_mesh.extent
    assert [v["pid"] for v in from_values.values()] == [v["pid"] for v in from_mesh.values()]
    assert [dict(p) for p, _ in from_values.items()] == [v["rank"] for v in from_mesh.values()]
    flat_values = from_values.flatten("n")
    flat_mesh = who.slice(**selection).flatten("n").whoami.call().get(timeout=T)
    assert [v["pid"] for v in flat_values.values()] == [v["pid"] for v in flat_mesh.values()]
    assert [dict(p) for p, _ in flat_values.items()] == [v["rank"] for v in flat_mesh.values()]
