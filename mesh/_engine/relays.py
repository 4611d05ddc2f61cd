"""`Relays`: functions a caller runs in this proc's runtime, answering with their Future.

A tree reduction uses them: a proc calls the actors of its group, folds their answers as they
arrive and answers its caller with one partial result. The function runs on the event loop
thread and must not block: it starts calls and returns a Future.
"""

from __future__ import annotations

from typing import Any, Protocol

from mesh._engine.future import Future
from mesh._engine.messages import Failure, Relay, Reply, invalid_fields
from transport import Envelope, Payload, TransportError, encode, get_logger, safe_str


class RelayHost(Protocol):
    """What relays need of their process's runtime."""

    @property
    def proc_id(self) -> str: ...

    def send_frames(
        self, address: str, header: Any, frames: list[Any]
    ) -> TransportError | None: ...


class Relays:
    """Runs `Relay` requests and sends each one's outcome to its caller."""

    def __init__(self, runtime: RelayHost) -> None:
        self._runtime = runtime
        self._log = get_logger("mesh.relays", proc=runtime.proc_id)

    def on_relay(self, envelope: Envelope) -> None:
        header: Relay = envelope.header
        reason = invalid_fields(header)
        if reason is not None:
            self._log.warning("message_ignored", kind="Relay", reason=reason)
            return
        try:
            function, args = envelope.payload.load()  # type: ignore[union-attr]
            future: Future[Any] = function(header.rank, *args)
        except Exception as exc:
            self._answer_error(header, exc)
            return
        future.add_done_callback(lambda done: self._answer(header, done))

    def _answer(self, header: Relay, done: Future[Any]) -> None:
        error = done.exception()
        if error is not None:
            self._answer_error(header, error)
            return
        reply = Reply(header.call_id, header.rank)
        try:
            frames = encode(reply, Payload.dump(done.get(0)))
        except Exception as exc:  # an answer that cannot travel must still end the call
            self._answer_error(header, exc)
            return
        self._runtime.send_frames(header.reply_to, Reply, frames)

    def _answer_error(self, header: Relay, error: BaseException) -> None:
        failure = Failure(header.call_id, header.rank, "raised")
        try:
            frames = encode(failure, Payload.dump(error))
        except Exception:  # the error itself cannot travel: its description can
            text = f"{type(error).__name__}: {safe_str(error)}"
            frames = encode(failure, Payload.dump(RuntimeError(f"relay failed with {text}")))
        self._runtime.send_frames(header.reply_to, Failure, frames)
