"""The control channel between the chaos harness and the workload's client process.

JSON lines over a socket pair that the client inherits. Either side sends notes (one-way) and
requests (answered by a reply with the same id); a reader thread hands what arrives to a
callback. It carries little (targets, events, progress), so simplicity beats speed.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading
from collections.abc import Callable
from typing import Any

Message = dict[str, Any]
#: The environment variable that gives the client the file descriptor of its end.
CHANNEL_FD_ENV = "MESHVISOR_CHAOS_FD"


class ChannelClosed(ConnectionError):
    """The other side of the chaos channel has gone away."""


class Channel:
    """One end of the channel: `send` notes, `request` and wait for the answer, and
    receive everything else through `on_message` (called on the reader thread)."""

    def __init__(self, sock: socket.socket, on_message: Callable[[Message], None]) -> None:
        self._socket = sock
        self._on_message = on_message
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[threading.Event, list[Message]]] = {}
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="chaos-channel", daemon=True)
        self._reader.start()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, message: Message) -> None:
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        with self._send_lock:
            try:
                self._socket.sendall(data)
            except OSError as exc:
                raise ChannelClosed(f"the chaos channel is closed: {exc}") from exc

    def request(self, op: str, wait_s: float, **args: Any) -> Any:
        """Ask the other side to do `op` (waiting at most `wait_s`); returns its value or
        raises its error."""
        call_id = next(self._ids)
        done = threading.Event()
        answer: list[Message] = []
        self._waiting[call_id] = (done, answer)
        try:
            self.send({"type": "request", "id": call_id, "op": op, "args": args})
            if not done.wait(wait_s):
                raise TimeoutError(f"the chaos client did not answer {op!r} within {wait_s} s")
        finally:
            self._waiting.pop(call_id, None)
        if not answer:
            raise ChannelClosed(f"the chaos channel closed while waiting for {op!r}")
        if not answer[0]["ok"]:
            raise RuntimeError(f"{op} failed in the chaos client: {answer[0]['error']}")
        return answer[0].get("value")

    def answer(self, request: Message, value: Any = None, error: str | None = None) -> None:
        reply: Message = {"type": "reply", "id": request["id"], "ok": error is None}
        reply["value" if error is None else "error"] = value if error is None else error
        try:
            self.send(reply)
        except ChannelClosed:
            pass  # the harness has gone: nobody needs the answer

    def _read(self) -> None:
        buffer = b""
        try:
            while True:
                chunk = self._socket.recv(65536)
                if not chunk:
                    return
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    self._receive(json.loads(line))
        except OSError:
            return
        finally:
            self._closed.set()
            for done, _ in list(self._waiting.values()):
                done.set()
            self._on_message({"type": "closed"})

    def _receive(self, message: Message) -> None:
        if message.get("type") == "reply":
            waiting = self._waiting.get(message["id"])
            if waiting is not None:
                waiting[1].append(message)
                waiting[0].set()
            return
        self._on_message(message)

    def close(self) -> None:
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()
