"""A test's own inbox and an outbox that sends to it, over ipc in a private directory: the
raw link the inbox tests (lone replies, keyed calls) drive with hand-made frames."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import Any

import transport
from transport import Envelope, Outbox, new_context, private_runtime_dir


class InboxLink:
    """`make_inbox(context, address)` builds the inbox; `receive_once(wait_ms)` is how a
    subclass reads it (None: nothing yet)."""

    def __init__(self, prefix: str, make_inbox: Callable[[Any, str], Any]) -> None:
        self.folder = private_runtime_dir(prefix)
        self.context = new_context()
        self.inbox = make_inbox(self.context, f"ipc://{self.folder}/in")
        self.outbox = Outbox(self.context)

    def receive_once(self, wait_ms: int) -> tuple[Any, ...] | Envelope | None:
        raise NotImplementedError

    def send(self, frames: list[Any]) -> None:
        self.outbox.send(self.inbox.address, frames)

    def receive(self, timeout_s: float = 30.0) -> tuple[Any, ...] | Envelope:
        """The next message that is not dropped (one read as its ints and body: a tuple)."""
        deadline = time.monotonic() + timeout_s
        while (got := self.receive_once(1000)) is None:
            assert time.monotonic() < deadline, "a message sent was never received"
        return got

    def close(self) -> None:
        self.outbox.close(0)
        self.inbox.close()
        transport.close_context(self.context)
        shutil.rmtree(self.folder, ignore_errors=True)
