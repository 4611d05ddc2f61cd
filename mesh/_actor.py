"""`Actor` and `@endpoint`: user classes whose methods can be called across processes.

An endpoint is reached on a mesh as an attribute (``actors.step``), so its name must not be one
the mesh handle already has (``actors.stop`` is the mesh's own ``stop``). The API layer, which
this leaf cannot import, registers those names with `reserve_endpoint_names`; every `Actor`
subclass is checked against them when it is defined.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, ClassVar, Concatenate, Generic, ParamSpec, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")

#: Attribute names that endpoints cannot take, each with the mesh class that has it.
_RESERVED: dict[str, type] = {}


#: How many calls of `@concurrent_endpoint`s one actor runs at the same time, unless its class
#: sets `Actor.max_concurrent_calls`.
DEFAULT_MAX_CONCURRENT_CALLS = 16


class Actor:
    """Base class of user actors. Instances live in procs; their endpoints are called remotely.

    Optional hooks: ``__cleanup__(self, exc)`` (sync or async) runs once when the actor stops
    (`exc` None) or fails (`exc` the failure); `max_concurrent_calls` bounds how many calls of
    its `concurrent_endpoint`s run at once (a further one waits, and so does what follows it);
    `call_limit_s` is how long a call of its endpoints may run before the actor is declared
    stuck (None: the setting in force when its mesh is spawned decides; ``math.inf``: never),
    unless the endpoint sets its own (docs/call-watchdog.md).
    """

    max_concurrent_calls: ClassVar[int] = DEFAULT_MAX_CONCURRENT_CALLS
    call_limit_s: ClassVar[float | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_endpoint_names(cls)
        check_concurrency_bound(cls)
        check_call_limit(cls.call_limit_s, f"actor class {cls.__qualname__} sets call_limit_s")


class EndpointDef(Generic[P, R]):
    """An `@endpoint` method: on an instance it is the plain method, on a mesh a set of adverbs.

    `P` are its parameters after ``self``, `R` what the method returns (for ``async def``, the
    coroutine; a call through a mesh gives what it returns when awaited).
    """

    def __init__(
        self,
        function: Callable[Concatenate[Any, P], R],
        explicit_response_port: bool = False,
        *,
        concurrent: bool = False,
        call_limit_s: float | None = None,
    ) -> None:
        if not callable(function):
            raise TypeError(f"@endpoint decorates a function, got {function!r}")
        where = f"@endpoint {getattr(function, '__qualname__', function)!r} sets call_limit_s"
        #: How long one call may run before the actor is stuck; None: its class decides.
        self.call_limit_s = check_call_limit(call_limit_s, where)
        self.function = function
        #: The method's first argument (after self) is the call's response port (see `endpoint`).
        self.explicit_response_port = explicit_response_port
        self.name: str = function.__name__
        self.owner: type | None = None
        self.is_async = inspect.iscoroutinefunction(function)
        #: Whether its calls may overlap other messages of the actor (`concurrent_endpoint`).
        self.concurrent = concurrent
        functools.update_wrapper(self, function)  # type: ignore[arg-type]

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.owner = owner

    @overload
    def __get__(self, instance: None, owner: type) -> EndpointDef[P, R]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> Callable[P, R]: ...

    def __get__(self, instance: object | None, owner: type) -> Any:
        if instance is None:
            return self
        return self.function.__get__(instance, owner)  # type: ignore[attr-defined]


@overload
def endpoint(function: Callable[Concatenate[Any, P], R]) -> EndpointDef[P, R]: ...
@overload
def endpoint(
    *, explicit_response_port: bool = False, call_limit_s: float | None = None
) -> Callable[[Callable[..., Any]], EndpointDef[..., Any]]: ...


def endpoint(
    function: Any = None,
    *,
    explicit_response_port: bool = False,
    call_limit_s: float | None = None,
) -> Any:
    """Mark an actor method (``def`` or ``async def``) as callable through meshes.

    ``@endpoint(call_limit_s=60)``: a call that runs longer is declared stuck (a deadlock, say):
    its caller gets a `SupervisionError`, the actor fails and its proc is stopped; it overrides
    `Actor.call_limit_s` and the ``call_limit_s`` setting (``math.inf``: no limit). See
    docs/call-watchdog.md.

    ``@endpoint(explicit_response_port=True)``: the method gets its call's response port as
    its first argument (after ``self``) and answers through it, once, now or later:
    ``port.send(value)`` or ``port.exception(error)``; what it returns is ignored. Callers call
    it as any endpoint, without the port. Unlike Monarch, an exception that escapes it before
    the port answered answers the call (the actor lives on); after, it fails the actor.
    """
    if function is None:
        check_call_limit(call_limit_s, "@endpoint(call_limit_s=...)")
        return lambda method: EndpointDef(method, explicit_response_port, call_limit_s=call_limit_s)
    return EndpointDef(function, explicit_response_port, call_limit_s=call_limit_s)


@overload
def concurrent_endpoint(method: Callable[Concatenate[Any, P], R], /) -> EndpointDef[P, R]: ...
@overload
def concurrent_endpoint(
    method: None = None, /, *, call_limit_s: float | None = None
) -> Callable[[Callable[Concatenate[Any, P], R]], EndpointDef[P, R]]: ...


def concurrent_endpoint(method: Any = None, /, *, call_limit_s: float | None = None) -> Any:
    """Mark an actor method as an endpoint whose calls may run while the actor handles its
    other messages (``@concurrent_endpoint`` or ``@concurrent_endpoint()``; `call_limit_s` as
    for `endpoint`).

    Calls start in arrival order, like every message; once started, a concurrent call does not
    hold up the messages behind it, so it overlaps later calls (concurrent or not). Ordinary
    endpoints still run one at a time. At most `Actor.max_concurrent_calls` run at once per
    actor; the next one waits, in order, with everything behind it. A stop waits for the
    concurrent calls in progress. Unlike Monarch's (async only, a task), a ``def`` endpoint
    is allowed too: it runs on its own worker thread.
    """
    if method is None:
        check_call_limit(call_limit_s, "@concurrent_endpoint(call_limit_s=...)")
        return functools.partial(concurrent_endpoint, call_limit_s=call_limit_s)
    if isinstance(method, EndpointDef):
        raise TypeError(
            "@concurrent_endpoint replaces @endpoint: use one of them on a method, not both."
        )
    return EndpointDef(method, concurrent=True, call_limit_s=call_limit_s)


def check_call_limit(value: object, where: str) -> float | None:
    """`value` as a call limit: None (not set here) or seconds > 0, ``math.inf`` meaning no
    limit; else an error that starts with `where`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{where} = {value!r}: it must be a number of seconds (or None to leave it to "
            "the next level, math.inf for no limit)."
        )
    if math.isnan(value) or value <= 0:
        raise ValueError(
            f"{where} = {value!r}: it must be a number of seconds > 0 (math.inf for no "
            "limit); a call cannot be given no time at all."
        )
    return float(value)


def check_concurrency_bound(cls: type) -> None:
    """Raise a TypeError unless `cls.max_concurrent_calls` is a positive int."""
    bound = getattr(cls, "max_concurrent_calls", DEFAULT_MAX_CONCURRENT_CALLS)
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 1:
        raise TypeError(
            f"actor class {cls.__qualname__} sets max_concurrent_calls = {bound!r}: it must "
            "be a positive int (how many calls of its concurrent endpoints run at once)."
        )


def endpoints_of(cls: type) -> dict[str, EndpointDef[..., Any]]:
    """Every endpoint of an actor class, by name, including inherited ones."""
    found: dict[str, EndpointDef[..., Any]] = {}
    seen: set[str] = set()
    for klass in cls.__mro__:  # the most derived definition of a name decides
        for name, value in vars(klass).items():
            if name not in seen and isinstance(value, EndpointDef):
                found[name] = value
            seen.add(name)
    return found


def reserve_endpoint_names(mesh_class: type) -> None:
    """Refuse, as endpoint names, the public attributes of `mesh_class` (the handle endpoints
    are reached through), so that no endpoint is hidden behind one of them."""
    names = set(dir(mesh_class))
    for klass in mesh_class.__mro__:
        names.update(vars(klass).get("__annotations__", {}))
    for name in names:
        if not name.startswith("_"):
            _RESERVED.setdefault(name, mesh_class)


def check_endpoint_names(cls: type) -> None:
    """Raise a TypeError naming the first endpoint of `cls` that a mesh could not reach."""
    for name, found in endpoints_of(cls).items():
        problem = _name_problem(name)
        if problem is not None:
            owner = found.owner
            where = "" if owner in (None, cls) else f" (inherited from {owner.__qualname__})"
            raise TypeError(
                f"actor class {cls.__qualname__} cannot have an endpoint named {name!r}"
                f"{where}: {problem}; rename the endpoint, for example to "
                f"{_suggest(owner or cls, name)!r}."
            )


def _name_problem(name: str) -> str | None:
    """Why a mesh could not reach an endpoint called `name`, or None if it can."""
    if name.startswith("_"):
        return (
            "names starting with '_' are private or special on a mesh, so "
            f"`actors.{name}` is never looked up as an endpoint"
        )
    clash = _RESERVED.get(name)
    if clash is not None:
        return (
            f"{clash.__name__}.{name} already exists, so `actors.{name}` would be the "
            "mesh's own attribute, not the endpoint"
        )
    return None


def _suggest(cls: type, name: str) -> str:
    """A free endpoint name close to `name`."""
    stem = name.strip("_") or "endpoint"
    return stem if _name_problem(stem) is None else f"{cls.__name__.lower()}_{stem}"


def check_actor_class(cls: object) -> type[Actor]:
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"spawn() needs a subclass of mesh.Actor, got {cls!r}")
    return cls


def resolve_endpoint(cls: type, name: str) -> EndpointDef[..., Any]:
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
