"""A mypy plugin that types endpoint calls: on an ``ActorMesh[Trainer]``, ``actors.step`` is an
``EndpointRef[P, R]`` with the parameters `P` and result `R` of ``Trainer.step``, so
``actors.step.call("3")`` is an error where ``step`` takes an int.

Python's types cannot map the attributes of an actor class onto its mesh handle, so without
this plugin ``actors.step`` is ``EndpointRef[..., Any]``: every call is accepted and gives Any.
Enable it in the mypy configuration (``pyproject.toml``)::

    [tool.mypy]
    plugins = ["mesh.mypy"]
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from mypy.checker import TypeChecker
from mypy.errorcodes import ATTR_DEFINED
from mypy.expandtype import expand_type_by_instance
from mypy.maptype import map_instance_to_supertype
from mypy.nodes import VAR_NO_INFO, Decorator, FuncBase, TypeInfo, Var
from mypy.plugin import AttributeContext, Plugin
from mypy.types import AnyType, Instance, Type, TypeOfAny, TypeVarType, get_proper_type

__all__ = ("plugin",)

#: Public names of the classes the plugin works with (their defining modules may move).
_ACTOR_MESH = "mesh.ActorMesh"
_ENDPOINT_DEF = "mesh.EndpointDef"


class _MeshPlugin(Plugin):
    """Types what `ActorMesh.__getattr__` answers (the endpoints of its actor class)."""

    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        owner, _, name = fullname.rpartition(".")
        if not owner.endswith(".ActorMesh"):  # cheap test first: this runs for every attribute
            return None
        mesh, endpoint_def = self._class(_ACTOR_MESH), self._class(_ENDPOINT_DEF)
        if mesh is None or endpoint_def is None or owner != mesh.fullname or mesh.get(name):
            return None
        return partial(_endpoint_ref, name, endpoint_def)

    def _class(self, public_name: str) -> TypeInfo | None:
        found = self.lookup_fully_qualified(public_name)
        return found.node if found is not None and isinstance(found.node, TypeInfo) else None


def _endpoint_ref(name: str, endpoint_def: TypeInfo, ctx: AttributeContext) -> Type:
    """The type of ``actors.<name>``: `EndpointRef` typed like the endpoint `name`."""
    ref, actor = get_proper_type(ctx.default_attr_type), _actor_class(ctx)
    if not isinstance(ref, Instance) or actor is None:
        return ctx.default_attr_type  # the actor class is not known statically
    declared = _declared_type(actor, name, ctx)
    if declared is None:
        return AnyType(TypeOfAny.from_error)
    if not (isinstance(declared, Instance) and declared.type.has_base(endpoint_def.fullname)):
        _fail_no_endpoint(actor, name, ctx, f"{actor.type.name}.{name} is not an endpoint")
        return AnyType(TypeOfAny.from_error)
    params, result = map_instance_to_supertype(declared, endpoint_def).args
    return ref.copy_modified(args=[params, _awaited(result)])


def _actor_class(ctx: AttributeContext) -> Instance | None:
    """The actor class of the mesh, where it is known (not Any)."""
    mesh = ctx.type
    if not isinstance(mesh, Instance) or not mesh.args:
        return None
    actor = get_proper_type(mesh.args[0])
    if isinstance(actor, TypeVarType):
        actor = get_proper_type(actor.upper_bound)
    return actor if isinstance(actor, Instance) else None


def _declared_type(actor: Instance, name: str, ctx: AttributeContext) -> Type | None:
    """The type of attribute `name` of the actor class, as seen on an instance of `actor`;
    None after reporting why there is none."""
    found = actor.type.get(name)
    node = found.node if found is not None else None
    if isinstance(node, Decorator):
        node = node.var
    if isinstance(node, FuncBase):
        _fail_no_endpoint(actor, name, ctx, "it is a method; decorate it with @endpoint")
        return None
    if not isinstance(node, Var):
        _fail_no_endpoint(actor, name, ctx, "no such attribute")
        return None
    if node.type is None:  # not inferred yet: check this function again later, as mypy does
        if isinstance(ctx.api, TypeChecker):
            ctx.api.handle_cannot_determine_type(name, ctx.context)
        return None
    if node.info is VAR_NO_INFO:
        return get_proper_type(node.type)
    return get_proper_type(
        expand_type_by_instance(node.type, map_instance_to_supertype(actor, node.info))
    )


def _fail_no_endpoint(actor: Instance, name: str, ctx: AttributeContext, why: str) -> None:
    ctx.api.fail(
        f'Actor class "{actor.type.name}" has no endpoint "{name}" ({why})',
        ctx.context,
        code=ATTR_DEFINED,
    )


def _awaited(result: Type) -> Type:
    """What a call through a mesh answers: for an ``async def`` endpoint, the awaited value."""
    proper = get_proper_type(result)
    if isinstance(proper, Instance) and proper.type.fullname == "typing.Coroutine":
        return proper.args[-1]
    return result


def plugin(version: str) -> type[Plugin]:
    """The entry point mypy calls when its configuration names ``mesh.mypy``."""
    return _MeshPlugin
