"""Endpoint definitions: names a mesh could not reach are refused when the actor class is
defined, and endpoint calls are type-checked by mypy (with the `mesh.mypy` plugin)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
from mypy import api as mypy_api

from mesh import Actor, ActorMesh, endpoint

ROOT = Path(__file__).resolve().parents[1]
#: The mesh attributes users meet most; every public attribute of ActorMesh is refused.
COMMON_MESH_ATTRIBUTES = (
    "stop",
    "size",
    "sizes",
    "slice",
    "flatten",
    "rename",
    "extent",
    "name",
    "on_failure",
)


def _method(self: Any) -> None:
    """An endpoint body; only its name matters here."""


def _actor_class_with_endpoint(name: str) -> type[Actor]:
    return type("Clashing", (Actor,), {name: endpoint(_method)})


# -- names a mesh could not reach ------------------------------------------------------------


@pytest.mark.parametrize("name", COMMON_MESH_ATTRIBUTES)
def test_an_endpoint_named_like_a_mesh_attribute_is_refused_at_class_definition(
    name: str,
) -> None:
    with pytest.raises(TypeError) as raised:
        _actor_class_with_endpoint(name)
    message = str(raised.value)
    assert f"actor class Clashing cannot have an endpoint named {name!r}" in message
    assert f"ActorMesh.{name} already exists" in message
    assert "rename the endpoint" in message


def test_every_public_attribute_of_actor_mesh_is_refused() -> None:
    """The refused names come from the mesh class itself, so they cannot drift from it."""
    public = [name for name in dir(ActorMesh) if not name.startswith("_")]
    assert set(COMMON_MESH_ATTRIBUTES) <= set(public)
    for name in public:
        with pytest.raises(TypeError, match=f"ActorMesh.{name} already exists"):
            _actor_class_with_endpoint(name)


@pytest.mark.parametrize("name", ["_helper", "__secret__", "__call__"])
def test_an_endpoint_name_starting_with_an_underscore_is_refused(name: str) -> None:
    with pytest.raises(TypeError, match=f"endpoint named {name!r}: names starting with '_'"):
        _actor_class_with_endpoint(name)


def test_an_inherited_endpoint_that_clashes_names_the_class_it_comes_from() -> None:
    class Stoppable:  # a mixin, not an actor: checked where it is mixed into one
        @endpoint
        def stop(self) -> None: ...

    with pytest.raises(TypeError) as raised:

        class Worker(Stoppable, Actor):
            pass

    message = str(raised.value)
    assert "Worker cannot have an endpoint named 'stop' (inherited from " in message
    assert "Stoppable" in message
    assert "stoppable_stop" in message  # the suggested name is free


def test_a_subclass_adding_a_clashing_endpoint_is_refused() -> None:
    class Base(Actor):
        @endpoint
        def step(self) -> None: ...

    with pytest.raises(TypeError, match="Derived cannot have an endpoint named 'slice'"):

        class Derived(Base):
            @endpoint
            def slice(self) -> None: ...


def test_plain_methods_may_use_mesh_attribute_names() -> None:
    """Only endpoints are reached through a mesh; other methods are the actor's own business."""

    class Fine(Actor):
        def stop(self) -> None: ...

        @property
        def name(self) -> str:
            return "fine"

        @endpoint
        def step(self) -> None: ...

    assert Fine().name == "fine"


# -- typing ------------------------------------------------------------------------------------

#: Each line's expectation is in its comment: `reveal: T` (the type mypy reveals, module
#: prefixes left out) or `error: text` (part of the error mypy reports); other lines: no error.
TYPED_CALLS = """
from mesh import Actor, ActorMesh, endpoint


class Trainer(Actor):
    @endpoint
    def step(self, n: int, *, scale: float = 1.0) -> float:
        return n * scale

    @endpoint
    async def fetch(self, key: str) -> bytes:
        return key.encode()

    def helper(self) -> float:
        return self.step(2)


def drive(trainers: ActorMesh[Trainer]) -> None:
    reveal_type(trainers.step)  # reveal: EndpointRef[[n: int, *, scale: float =], float]
    reveal_type(trainers.step.call(3))  # reveal: Future[ValueMesh[float]]
    reveal_type(trainers.step.call_one(3, scale=0.5))  # reveal: Future[float]
    reveal_type(trainers.fetch.choose("key"))  # reveal: Future[bytes]
    reveal_type(trainers.step.stream(3))  # reveal: Iterator[Future[float]]
    trainers.step.broadcast(3)
    reveal_type(trainers.slice(gpus=0))  # reveal: ActorMesh[Trainer]
    reveal_type(trainers.stop())  # reveal: Future[None]
    trainers.step.call("3")  # error: "call" of "EndpointRef" has incompatible type "str"
    trainers.step.call(3, 4)  # error: Too many positional arguments for "call"
    trainers.step.call_one(3, scale="x")  # error: Argument "scale" to "call_one"
    trainers.stpe.call(3)  # error: Actor class "Trainer" has no endpoint "stpe"
    trainers.helper.call()  # error: "helper" (it is a method; decorate it with @endpoint)
"""

#: Without the plugin, endpoints are untyped but never wrongly refused.
UNTYPED_CALLS = """
from mesh import Actor, ActorMesh, endpoint


class Trainer(Actor):
    @endpoint
    def step(self, n: int) -> float:
        return float(n)


def drive(trainers: ActorMesh[Trainer]) -> None:
    reveal_type(trainers.step)  # reveal: EndpointRef[..., Any]
    reveal_type(trainers.step.call("anything", 1, 2))  # reveal: Future[ValueMesh[Any]]
    reveal_type(Trainer.step)  # reveal: EndpointDef[[n: int], float]
"""


def _mypy(tmp_path: Path, source: str, *, plugin: bool) -> dict[int, list[str]]:
    """Run mypy --strict on `source`; its notes and errors by line, module prefixes removed."""
    (tmp_path / "snippet.py").write_text(textwrap.dedent(source))
    config = tmp_path / "mypy.ini"
    config.write_text(
        "[mypy]\nstrict = True\n"
        f"mypy_path = {ROOT}\ncache_dir = {tmp_path / 'cache'}\n"
        + ("plugins = mesh.mypy\n" if plugin else "")
    )
    stdout, stderr, _ = mypy_api.run(["--config-file", str(config), str(tmp_path / "snippet.py")])
    found: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        match = re.match(r".*snippet\.py:(\d+): (?:note|error): (.*)", line)
        if match:
            text = re.sub(r"\b(?:\w+\.)+(?=\w)", "", match.group(2))  # mesh._values.X -> X
            found.setdefault(int(match.group(1)), []).append(text)
    assert found or not stderr, stderr
    return found


def _check(source: str, found: dict[int, list[str]]) -> None:
    lines = textwrap.dedent(source).splitlines()
    for number, line in enumerate(lines, start=1):
        reported = found.get(number, [])
        _, reveal, expected_type = line.partition("# reveal: ")
        _, error, expected_error = line.partition("# error: ")
        if reveal:
            assert reported == [f'Revealed type is "{expected_type}"'], (number, line, reported)
        elif error:
            assert any(expected_error in text for text in reported), (number, line, reported)
        else:
            assert not reported, (number, line, reported)


@pytest.mark.timeout(600)
def test_mypy_with_the_plugin_checks_endpoint_arguments_and_results(tmp_path: Path) -> None:
    _check(TYPED_CALLS, _mypy(tmp_path, TYPED_CALLS, plugin=True))


@pytest.mark.timeout(600)
def test_plain_mypy_accepts_endpoint_calls_as_untyped(tmp_path: Path) -> None:
    _check(UNTYPED_CALLS, _mypy(tmp_path, UNTYPED_CALLS, plugin=False))
