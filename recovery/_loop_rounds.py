"""`Rounds`: the decisions of a `LoopGroup`, step after step (plain logic, one thread).

A round gathers the loops that ask for the next step. It waits for every loop that took part
before (a replacement is not waited for: it joins the round it asks in), for at least
`min_replicas` of them, within bounds. Loops that do not hold the group's committed state (a
replacement, or every loop but one at the start) heal from those that do, which wait for the
heals, at their step boundary, so that their state stays put. Then every participant gets the
step's process group (`Go`); each votes once its exchange is done, and the step is committed
only if every participant voted yes; a failed participant or a no vote discards it at once,
and an abort notice wakes those still waiting in a collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._loop_protocol import (
    Answer,
    AskQuorum,
    Decision,
    Finished,
    Go,
    Healed,
    HealFrom,
    Retry,
    Vote,
)
from ._outcomes import Recovery, ReplicaGroupError, StepOutcome

Respond = Callable[[Answer], None]

#: Decisions kept for votes that come late (a loop still waiting in an aborted collective).
KEPT_DECISIONS = 8


@dataclass
class _Loop:
    index: int
    incarnation: int = 0
    phase: str = "starting"  # starting | live | failed | done
    synced: bool = False  # holds the group's committed state
    until: int = 0
    recovery: Recovery | None = None


@dataclass
class _Vote:
    """The step the current process group trains, and the votes on it."""

    quorum: int
    step: int
    members: tuple[int, ...]
    started: float
    votes: dict[int, Respond] = field(default_factory=dict)
    decided: bool | None = None


class Rounds:
    """The group's state and its answers; `abort(quorum, why)` posts an abort notice and
    `runners(ids)` gives the loop runners that heals take the state from."""

    def __init__(
        self,
        replicas: int,
        min_replicas: int,
        abort: Callable[[int, str], None],
        runners: Callable[[Sequence[int]], tuple[Any, ...]],
        step_timeout_s: float,
        wait_for_replicas_s: float,
    ) -> None:
        self.loops = [_Loop(index) for index in range(replicas)]
        self.min_replicas = min_replicas
        self._abort = abort
        self._runners = runners
        self.step_timeout_s = step_timeout_s
        self.wait_for_replicas_s = wait_for_replicas_s
        self.history: list[tuple[int, tuple[int, ...]]] = []
        self.outcomes: list[StepOutcome] = []
        self.recoveries: list[Recovery] = []
        self._waiting: dict[int, Respond] = {}  # asked for the next step
        self._waiting_since: float | None = None
        self._healing: set[int] = set()  # told to heal, not done yet
        self._held: dict[int, Respond] = {}  # donors and healed loops, until the heals end
        self._quorum = 0
        self._group: tuple[int, ...] | None = None  # members of the process group in use
        self._current: _Vote | None = None
        self._decisions: dict[tuple[int, int], Decision] = {}
        #: the quorums of the last two groups a step committed in (every member formed them)
        self.committed_quorums = (0, 0)

    @property
    def committed_steps(self) -> int:
        return len(self.history)

    # -- requests ------------------------------------------------------------------------------

    def ask(self, request: AskQuorum, respond: Respond) -> None:
        loop = self.loops[request.replica]
        if not self._current_incarnation(loop, request.incarnation, respond):
            return
        if loop.phase == "starting":
            loop.phase = "live"
        if loop.synced and request.step != self.committed_steps:
            loop.synced = False  # it says otherwise: it heals
        loop.until = request.until
        self._waiting[loop.index] = respond
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        self._try_close()

    def healed(self, request: Healed, respond: Respond) -> None:
        loop = self.loops[request.replica]
        if not self._current_incarnation(loop, request.incarnation, respond):
            return
        if loop.index not in self._healing:
            respond(Retry(f"replica {loop.index} was not asked to heal"))
            return
        self._healing.discard(loop.index)
        if not request.ok or request.step != self.committed_steps:
            respond(Retry(f"the heal of replica {loop.index} failed: {request.why}"))
        else:
            loop.synced = True
            if loop.recovery is not None:
                loop.recovery.healed_at = time.monotonic()
            self._held[loop.index] = respond
        self._try_finish_heals()

    def vote(self, request: Vote, respond: Respond) -> None:
        decided = self._decisions.get((request.quorum, request.step))
        current = self._current
        if decided is not None:
            respond(decided)
        elif current is None or (current.quorum, current.step) != (request.quorum, request.step):
            respond(Decision(False, f"no step {request.step} in quorum {request.quorum}"))
        elif request.replica not in current.members:
            respond(Decision(False, f"replica {request.replica} is not in the step's group"))
        elif not request.ok:
            current.votes[request.replica] = respond
            self._decide(False, f"replica {request.replica}: {request.why}")
        else:
            current.votes[request.replica] = respond
            if set(current.votes) == set(current.members):
                self._decide(True)

    # -- what the controller sees --------------------------------------------------------------

    def failed(self, index: int, why: str) -> None:
        """Loop `index` is gone (its proc died or hung): what waited on it goes on."""
        loop = self.loops[index]
        if loop.phase == "failed":
            return
        loop.phase, loop.synced = "failed", False
        loop.recovery = Recovery(index, time.monotonic(), why)
        self.recoveries.append(loop.recovery)
        self._waiting.pop(index, None)
        self._held.pop(index, None)
        self._healing.discard(index)
        current = self._current
        if current is not None and index in current.members:
            if current.decided is None:
                self._decide(False, f"replica {index} {why}")
            self._group = None
        self._try_finish_heals()
        self._try_close()

    def respawned(self, index: int) -> int:
        """Loop `index` runs again, in a new proc; returns its incarnation."""
        loop = self.loops[index]
        loop.incarnation += 1
        loop.phase = "starting"
        if loop.recovery is not None:
            loop.recovery.respawned_at = time.monotonic()
        return loop.incarnation

    def finished(self, index: int) -> None:
        self.loops[index].phase = "done"
        self._try_close()

    def tick(self) -> None:
        """Act on the time bounds: a round short of loops, a vote that does not come."""
        current, now = self._current, time.monotonic()
        overdue = current is not None and now - current.started > self.step_timeout_s
        if current is not None and current.decided is None and overdue:
            late = sorted(set(current.members) - set(current.votes))
            self._decide(False, f"replicas {late} did not vote within {self.step_timeout_s:g} s")
        if self._waiting_since is not None:
            waited = now - self._waiting_since
            if waited > self.wait_for_replicas_s:
                raise ReplicaGroupError(
                    f"replicas {sorted(self._waiting)} waited {waited:.0f} s for a step: only "
                    f"{self._expected()} are expected and {self.min_replicas} are needed"
                )

    # -- rounds ------------------------------------------------------------------------------

    def _current_incarnation(self, loop: _Loop, incarnation: int, respond: Respond) -> bool:
        if incarnation == loop.incarnation and loop.phase != "failed":
            return True
        respond(Retry(f"replica {loop.index} incarnation {incarnation} is not the current one"))
        return False

    def _expected(self) -> list[int]:
        """Loops a round waits for: those that took part, and the first ones to start."""
        return [
            loop.index
            for loop in self.loops
            if loop.phase == "live" or (loop.phase == "starting" and loop.incarnation == 0)
        ]

    def _try_close(self) -> None:
        busy = self._healing or self._held
        if busy or not self._waiting or (self._current and self._current.decided is None):
            return
        if set(self._expected()) - set(self._waiting):
            return
        holders = [loop for loop in self.loops if loop.synced and loop.phase in ("live", "done")]
        if not holders and self.history:
            raise ReplicaGroupError(
                f"no live replica holds the state of committed step {self.committed_steps}: "
                "every one failed, so there is nothing to heal from (restart from a checkpoint)"
            )
        if not holders:  # nothing committed yet: the first to ask is the seed
            self.loops[min(self._waiting)].synced = True
            holders = [self.loops[min(self._waiting)]]
        ending = all(loop.phase == "done" for loop in holders)
        if len(self._waiting) < self.min_replicas and not ending:
            return
        self._waiting_since = None
        waiting, self._waiting = self._waiting, {}
        healers = [i for i in waiting if not self.loops[i].synced]
        self._held = {i: respond for i, respond in waiting.items() if i not in healers}
        donors = self._runners([loop.index for loop in holders])
        for index in healers:
            self._healing.add(index)
            waiting[index](HealFrom(self.committed_steps, donors))
        self._try_finish_heals()

    def _try_finish_heals(self) -> None:
        if self._healing or not self._held:
            return
        held, self._held = self._held, {}
        for index in [i for i in held if self.loops[i].until <= self.committed_steps]:
            held.pop(index)(Finished(self.committed_steps))
        if not held:
            return
        if len(held) < self.min_replicas:
            for respond in held.values():
                respond(Retry(f"only replicas {sorted(held)} are up, {self.min_replicas} needed"))
            return
        self._go(tuple(sorted(held)), held)

    def _go(self, members: tuple[int, ...], held: dict[int, Respond]) -> None:
        if members != self._group:
            self._quorum += 1
            self._group = members
        step = self.committed_steps + 1
        self._current = _Vote(self._quorum, step, members, time.monotonic())
        for rank, index in enumerate(members):
            held[index](Go(self._quorum, rank, len(members), step, members))

    def _decide(self, commit: bool, why: str = "") -> None:
        current = self._current
        assert current is not None and current.decided is None
        current.decided = commit
        decision = Decision(commit, why)
        self._decisions[(current.quorum, current.step)] = decision
        for old in list(self._decisions)[:-KEPT_DECISIONS]:
            del self._decisions[old]
        self.outcomes.append(
            StepOutcome(
                current.step, commit, current.members, time.monotonic() - current.started, why
            )
        )
        if commit:
            self._committed(current)
        else:
            self._group = None  # a collective was given up: the next step forms a new group
            self._abort(current.quorum, why)
        for respond in current.votes.values():
            respond(decision)

    def _committed(self, current: _Vote) -> None:
        self.history.append((current.step, current.members))
        if current.quorum != self.committed_quorums[1]:
            self.committed_quorums = (self.committed_quorums[1], current.quorum)
        now = time.monotonic()
        for loop in self.loops:
            if loop.index not in current.members:
                loop.synced = False  # it missed this step: it heals before its next one
            elif loop.recovery is not None and loop.recovery.first_commit_at is None:
                loop.recovery.first_commit_at = now
