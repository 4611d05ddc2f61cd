"""Accumulate: a mesh call's answers reduced with a user reducer, per host group in a relay
proc (a tree) or at the client, with real procs; failures of a rank or of the reducer end it."""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from polling import wait_until

from mesh import Accumulator, Actor, ReducerError, current_rank, endpoint, this_host
from supervision import ActorError, SupervisionError

T = 30.0
SIZE = 4


class Values(Actor):
    """Answers a value per rank."""

    @endpoint
    def value(self, values: list[Any]) -> Any:
        return values[current_rank().rank]

    @endpoint
    async def avalue(self, values: list[Any]) -> Any:
        return values[current_rank().rank]

    @endpoint
    def raise_on(self, rank: int) -> int:
        if current_rank().rank == rank:
            raise KeyError(f"rank {rank} has no value")
        return 1

    @endpoint
    def die_on(self, rank: int) -> int:
        if current_rank().rank == rank:
            os._exit(7)
        return 1


def picky_add(total: int, value: Any) -> int:
    """A reducer that accepts ints only."""
    if not isinstance(value, int):
        raise TypeError(f"cannot add {value!r}")
    return total + value


@pytest.fixture(scope="module")
def values_mesh() -> Iterator[Any]:
    """One mesh of SIZE actors for the module (the property test runs many reductions)."""
    procs = this_host().spawn_procs(per_host={"gpus": SIZE})
    try:
        yield procs.spawn("values", Values)
    finally:
        procs.stop().get(timeout=T)


@pytest.mark.parametrize("tree", [True, False])
@pytest.mark.parametrize("fan_in", [1, 2, 8])
def test_accumulate_sums_every_answer(values_mesh: Any, tree: bool, fan_in: int) -> None:
    accumulator = Accumulator(values_mesh.value, 0, operator.add, tree=tree, fan_in=fan_in)
    assert accumulator.accumulate([1, 20, 300, 4000]).get(timeout=T) == 4321


def test_accumulate_of_a_slice_and_of_async_endpoints(values_mesh: Any) -> None:
    middle = values_mesh.slice(gpus=slice(1, 3))
    assert Accumulator(middle.avalue, 0, operator.add).accumulate([5, 7]).get(timeout=T) == 12
    union = Accumulator(values_mesh.avalue, frozenset(), operator.or_, fan_in=3)
    sets = [frozenset({r, r + 1}) for r in range(SIZE)]
    assert union.accumulate(sets).get(timeout=T) == frozenset(range(SIZE + 1))


@settings(max_examples=25, deadline=None)
@given(
    bounds=st.tuples(st.integers(0, SIZE - 1), st.integers(1, SIZE)).filter(lambda b: b[0] < b[1]),
    numbers=st.lists(st.integers(-(10**6), 10**6), min_size=SIZE, max_size=SIZE),
    reducer=st.sampled_from([(operator.add, 0), (max, -(10**9)), (min, 10**9)]),
    fan_in=st.integers(1, SIZE + 1),
    tree=st.booleans(),
)
def test_accumulate_equals_the_sequential_fold(
    values_mesh: Any,
    bounds: tuple[int, int],
    numbers: list[int],
    reducer: tuple[Callable[[int, int], int], int],
    fan_in: int,
    tree: bool,
) -> None:
    """For an associative, commutative reducer with its identity, any mesh slice, grouping
    and arrival order give the fold of the answers in rank order."""
    start, stop = bounds
    combine, identity = reducer
    mesh = values_mesh.slice(gpus=slice(start, stop))
    answers = numbers[: stop - start]
    accumulator = Accumulator(mesh.value, identity, combine, tree=tree, fan_in=fan_in)
    expected = functools.reduce(combine, answers, identity)
    assert accumulator.accumulate(answers).get(timeout=T) == expected


@pytest.mark.parametrize("tree", [True, False])
def test_a_reducer_that_raises_names_itself_and_the_ranks(values_mesh: Any, tree: bool) -> None:
    accumulator = Accumulator(values_mesh.value, 0, picky_add, tree=tree, fan_in=2)
    with pytest.raises(ReducerError) as info:
        accumulator.accumulate([1, 2, "three", 4]).get(timeout=T)
    message = str(info.value)
    assert "the reducer picky_add raised TypeError: cannot add 'three'" in message
    assert "ranks [{'gpus': 2}]" in message
    assert Accumulator(values_mesh.value, 0, picky_add).accumulate([1] * SIZE).get(timeout=T) == 4


@pytest.mark.parametrize("tree", [True, False])
def test_a_rank_that_raises_fails_the_accumulate_with_its_error(
    values_mesh: Any, tree: bool
) -> None:
    accumulator = Accumulator(values_mesh.raise_on, 0, operator.add, tree=tree, fan_in=2)
    with pytest.raises(ActorError, match="rank 3 has no value") as info:
        accumulator.accumulate(3).get(timeout=T)
    assert "{'gpus': 3}" in str(info.value)


@pytest.mark.parametrize(("dying", "tree"), [(0, True), (1, True), (1, False)])
def test_a_rank_that_dies_fails_the_accumulate_naming_it(
    make_procs: Callable[..., Any], root_events: list[Any], dying: int, tree: bool
) -> None:
    """Rank 0 leads its group's reduction (fan_in 2), rank 1 is a member of that group."""
    actors = make_procs({"gpus": 3}).spawn("values", Values)
    accumulator = Accumulator(actors.die_on, 0, operator.add, tree=tree, fan_in=2)
    with pytest.raises(SupervisionError) as info:
        accumulator.accumulate(dying).get(timeout=T)
    event = info.value.event
    assert event.mesh_name == "values"
    assert dict(event.rank or {}) == {"gpus": dying}
    assert event.actor_id is not None and event.actor_id.endswith(f"[{dying}]")
    wait_until(lambda: root_events, what="the death to reach the mesh's owner")


def test_bad_accumulator_input_is_refused_clearly(values_mesh: Any) -> None:
    with pytest.raises(TypeError, match="needs an endpoint of an actor mesh"):
        Accumulator(print, 0, operator.add)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable combine"):
        Accumulator(values_mesh.value, 0, "add")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fan_in of at least 1"):
        Accumulator(values_mesh.value, 0, operator.add, fan_in=0)
