"""`Actor` and `@endpoint`: user classes whose methods can be called across processes."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

F = TypeVar("F", bound=Callable[..., Any])


class Actor:
    """Base class of user actors. Instances live in procs; their endpoints are called remotely."""


class EndpointDef(Generic[F]):
    """An `@endpoint` method: on an instance it is the plain method, on a mesh a set of adverbs."""

    def __init__(self, function: F) -> None:
        if not callable(function):
            raise TypeError(f"@endpoint decorates a function, got {function!r}")
        self.function = function
        self.name = function.__name__
        self.is_async = inspect.iscoroutinefunction(function)
        functools.update_wrapper(self, function)  # type: ignore[arg-type]

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type) -> EndpointDef[F]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> F: ...

    def __get__(self, instance: object | None, owner: type) -> Any:
        if instance is None:
            return self
        return self.function.__get__(instance, owner)


def endpoint(function: F) -> EndpointDef[F]:
    """Mark an actor method (``def`` or ``async def``) as callable through meshes."""
    return EndpointDef(function)


def endpoints_of(cls: type) -> dict[str, EndpointDef[Any]]:
    """Every endpoint of an actor class, by name, including inherited ones."""
    found: dict[str, EndpointDef[Any]] = {}
    seen: set[str] = set()
    for klass in cls.__mro__:  # the most derived definition of a name decides
        for name, value in vars(klass).items():
            if name not in seen and isinstance(value, EndpointDef):
                found[name] = value
            seen.add(name)
    return found


def check_actor_class(cls: object) -> type[Actor]:
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"spawn() needs a subclass of mesh.Actor, got {cls!r}")
    return cls


def resolve_endpoint(cls: type, name: str) -> EndpointDef[Any]:
    """The endpoint `name` of `cls`, or an AttributeError that says what is wrong."""
    found = endpoints_of(cls).get(name)
    if found is not None:
        return found
    if callable(getattr(cls, name, None)):
        raise AttributeError(
            f"{cls.__name__}.{name} is a method but not an endpoint; decorate "
            "it with @endpoint to call it through a mesh."
        )
    available = ", ".join(sorted(endpoints_of(cls))) or "none"
    raise AttributeError(
        f"actor class {cls.__name__} has no endpoint {name!r} (its endpoints: {available})."
    )
