"""The errors a call ends with when its answer is not a plain value: a failure the callee
reported, an answer that cannot be unpickled here, the loss of the callee's proc."""

from __future__ import annotations

from typing import Any

from mesh._engine.peers import ActorMeshView, ProcPeer
from supervision import ActorError, SupervisionError, SupervisionEvent
from transport import Payload, loads


def gone_error(
    peer: ProcPeer, event: SupervisionEvent, mesh: ActorMeshView | None
) -> SupervisionError:
    """The error for a call to an actor on `peer`, whose proc failed or was stopped (`event`):
    about the actor when the actor mesh called is known, else about the proc."""
    return SupervisionError(event if mesh is None else mesh.proc_failed(peer, event))


def unreadable_error(call_id: int, exc: Exception) -> ActorError:
    """The error for an answer to call `call_id` whose value cannot be unpickled here."""
    return ActorError(f"the result of call {call_id} could not be unpickled here: {exc!r}")


def failure_error(call_id: int, kind: str, payload: Payload | None) -> BaseException:
    """The error a Failure of `kind` to call `call_id` carries (its detail in `payload`)."""
    try:
        detail = payload.load()  # type: ignore[union-attr]
        if kind == "exception":
            return _actor_error(*detail)
        if kind == "raised" and isinstance(detail, BaseException):
            return detail
        return SupervisionError(detail)
    except Exception as exc:  # the call must end even when its error cannot be rebuilt
        why = f"call {call_id} failed ({kind}), but the error could not be unpickled here"
        return ActorError(f"{why}: {exc!r}")


def _actor_error(
    fields: dict[str, Any], original: bytes | None, original_class: bytes | None
) -> ActorError:
    """Rebuild the caller's ActorError. It keeps the original type even when the exception
    instance cannot be unpickled here (a constructor with extra arguments, say)."""
    exception = _unpickled_or_none(original)
    exception_class = _unpickled_or_none(original_class) if exception is None else None
    message = (
        f"endpoint {fields['endpoint']!r} of mesh {fields['mesh_name']!r} at rank "
        f"{fields['rank']} (pid {fields['pid']} on {fields['host']}) raised "
        f"{fields['exception_type']}: {fields['message']}"
    )
    fields = {k: v for k, v in fields.items() if k not in ("message", "call_rank")}
    return ActorError.wrap(message, exception=exception, exception_class=exception_class, **fields)


def _unpickled_or_none(data: bytes | None) -> Any:
    if data is None:
        return None
    try:
        return loads(data)
    except Exception:
        return None
