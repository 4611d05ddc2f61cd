"""Recording what supervision tells a handler, shared by the supervision tests."""

from __future__ import annotations

import threading
from typing import Any

from polling import wait_until

from supervision import SupervisionEvent

WAIT_S = 30.0


class Recorder:
    """A failure handler that records every event it is given and returns `decision` (an
    exception is raised instead)."""

    def __init__(self, decision: Any = True) -> None:
        self.decision = decision
        self.events: list[SupervisionEvent] = []
        self._lock = threading.Lock()

    def __call__(self, event: SupervisionEvent) -> Any:
        with self._lock:
            self.events.append(event)
        if isinstance(self.decision, BaseException):
            raise self.decision
        return self.decision

    def wait(self, count: int = 1, timeout: float = WAIT_S) -> list[SupervisionEvent]:
        wait_until(
            lambda: len(self.events) >= count,
            timeout,
            f"{count} supervision event(s), got {self.events}",
        )
        return list(self.events)
