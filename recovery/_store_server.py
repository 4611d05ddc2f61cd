"""`StoreServer`: a replica group's key-value store, served by the controller on a thread.

Replicas form their gloo process groups through it (rendezvous) and read the controller's abort
notices in it. It replaces torch's TCPStore, whose server takes anyone who reaches its port
(and listens on every interface), and stalls while its sockets look up a peer's name in DNS.
It listens where the runtime's inboxes do (`transport.Responder`): on ipc, in a private
directory, for replicas on this host; on tcp at `host` too when the allocation has CURVE
keys, authenticated, for replicas whose ipc file is out of reach. Requests are bytes checked
against the store's bounds (`_store_wire`); a bad one gets an error, never a crash. The waits
of a client whose connection closed (its process died) are dropped then, not at their timeout.
Its connections (ipc and tcp) are closed after `heartbeat_timeout_s` of silence (a stopped
process, a vanished host), the replica group's own failure-detection timeout; a client back
from a pause connects again and sends its request in flight again, which is answered at most
once (`_store_replies`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import threading
import time

from mesh import current_settings
from mesh.tooling import write_owner_file
from transport import (
    Addresses,
    Responder,
    close_context,
    configured_keys,
    get_logger,
    new_context,
    private_runtime_dir,
)

from ._store_replies import LastWrites
from ._store_state import Answer, StoreState
from ._store_wire import MAX_FRAME_BYTES, BadRequest, Status, encode_reply, parse_request

#: How long `close` waits for the server's thread to end.
STOP_WAIT_S = 5.0


class StoreServer:
    """The store, served until `close` (from any thread). Its connections close after
    `heartbeat_timeout_s` without a word from the peer (None: this process's settings'
    `heartbeat_timeout_s`, the timeout after which a silent proc counts as hung)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        name: str = "store",
        heartbeat_timeout_s: float | None = None,
    ) -> None:
        if heartbeat_timeout_s is None:
            heartbeat_timeout_s = current_settings().heartbeat_timeout_s
        self._context = new_context()
        self._directory = private_runtime_dir("meshvisor-store-")
        write_owner_file(self._directory)  # a later client sweeps it if this process is killed
        tcp = f"tcp://{host}:*" if configured_keys() is not None else None
        self._wake_read, self._wake_write = os.pipe()
        try:
            self._responder = Responder(
                self._context,
                f"ipc://{self._directory}/store",
                tcp,
                max_bytes=MAX_FRAME_BYTES,
                heartbeat_timeout_s=heartbeat_timeout_s,
            )
        except BaseException:
            self._release()
            raise
        self.addresses: Addresses = self._responder.addresses
        self._state = StoreState()
        self._writes = LastWrites()
        self._stopping = False
        self._log = get_logger("recovery.store", group=name)
        self._thread = threading.Thread(target=self._serve, name=f"meshvisor-store-{name}")
        self._thread.daemon = True
        self._thread.start()
        atexit.register(self.close)  # a controller that exits without closing leaves no file

    def close(self) -> None:
        """Stop serving: waiting requests get an error; the socket file goes."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.close)
        with contextlib.suppress(OSError):
            os.write(self._wake_write, b"x")
        self._thread.join(STOP_WAIT_S)
        if self._thread.is_alive():
            self._log.warning("store_left_running", reason="its thread did not end in time")
            return
        self._release()

    def waiting(self) -> int:
        """How many GET and WAIT requests wait for their keys now."""
        return self._state.waiting()

    def _release(self) -> None:
        close_context(self._context)
        shutil.rmtree(self._directory, ignore_errors=True)
        for descriptor in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(descriptor)

    def _serve(self) -> None:
        try:
            while not self._stopping:
                if self._responder.poll(self._wait_ms(), self._wake_read):
                    self._take_requests()
                    self._state.forget(self._responder.gone_nowait())
                self._send(self._state.expire(time.monotonic()))
            self._send(list(self._state.drop_waiting()))
        finally:
            self._responder.close()

    def _wait_ms(self) -> int:
        """How long to wait for requests: until the next waiting one times out (-1: none)."""
        deadline = self._state.next_deadline()
        return -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1e3) + 1)

    def _take_requests(self) -> None:
        """Answer the requests that wait (a bounded batch: deadlines are looked at between)."""
        for _ in range(256):
            received = self._responder.receive_nowait()
            if received is None:
                return
            asker, frames = received
            self._send(self._answer(asker, frames))

    def _answer(self, asker: bytes, frames: list[bytes]) -> list[Answer]:
        try:
            request = parse_request(frames)
        except BadRequest as exc:
            self._log.warning("store_request_refused", reason=str(exc))
            return [(asker, encode_reply(exc.request_id, Status.ERROR, [str(exc).encode()]))]
        replayed = self._writes.replay(asker, request)
        if replayed is not None:  # sent again after a reconnect: applied already
            return [(asker, replayed)]
        try:
            answers = self._state.answer(asker, request, time.monotonic())
        except Exception as exc:  # a bug answering one request must not end the store
            self._log.exception("store_request_failed", reason=repr(exc))
            why = f"the store could not answer this request: {exc!r}"
            return [(asker, encode_reply(request.request_id, Status.ERROR, [why.encode()]))]
        if answers and answers[0][0] == asker:  # a write's own answer comes first, at once
            self._writes.keep(asker, request, answers[0][1])
        return answers

    def _send(self, answers: list[Answer]) -> None:
        for asker, frames in answers:
            self._responder.reply(asker, frames)
