"""Actors for the fan-out tests: they record the order of what they receive, or die on cue."""

from __future__ import annotations

import signal
from typing import Any

from mesh import Actor, current_rank, endpoint
from mesh.testing import signal_this_process


class Recorder(Actor):
    """Keeps every token it is sent, in the order its messages arrive."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    @endpoint
    def note(self, token: int) -> None:
        self.tokens.append(token)

    @endpoint
    def take(self) -> list[int]:
        """The tokens so far, and start over."""
        tokens, self.tokens = self.tokens, []
        return tokens


class Dies(Actor):
    """Answers with its rank; the rank named dies instead."""

    @endpoint
    def rank(self) -> int:
        return current_rank().rank

    @endpoint
    def rank_or_die(self, doomed: int) -> int:
        if current_rank().rank == doomed:
            signal_this_process(signal.SIGKILL)
        return current_rank().rank

    @endpoint
    def fail(self, message: str) -> Any:
        raise ValueError(message)

    @endpoint
    def rank_or_raise(self, odd_raise: bool) -> int:
        """Its rank; an odd rank raises instead (when `odd_raise`)."""
        rank = current_rank().rank
        if odd_raise and rank % 2:
            raise ValueError(f"rank {rank} refuses")
        return rank


class RankedRecorder(Recorder):
    """A `Recorder` whose `note_rank` also answers with the rank that noted the token."""

    @endpoint
    def note_rank(self, token: int) -> int:
        self.tokens.append(token)
        return current_rank().rank
