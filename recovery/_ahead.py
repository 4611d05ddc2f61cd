"""The local half of a step (forward and backward), and a replacement's first one computed ahead.

A replacement joins its group holding committed step c, and its first step is c+1. By then the
others have their gradients of that step (it joins the step in flight) or compute them beside
it, and the whole group waits for its forward and backward passes. So as soon as it has caught
up (`Replica.rejoin`), it computes that gradient on a thread holding the step lock, exactly as
`prepare` would: `prepare` of step c+1 finds it and only exchanges it (the same bits), while
any other change of its state first puts back what the pass changed (`drop_ahead`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

from transport import get_logger

from ._arithmetic import local_gradient, restore_buffers, save_buffers
from ._heal_donor import DonorCache, StepStart
from ._position import DataPositioned, capture_position, restore_position

if TYPE_CHECKING:
    import torch

#: The longest a replacement's warm-up thread waits for its catch-up to end (each of the
#: catch-up's calls has a timeout of its own; past this, it computes nothing ahead).
AHEAD_WAIT_S = 600.0


class Ahead:
    """Whether a replica computed (or may still compute) a gradient ahead, whether it is
    computing one now (a `join` need not wait for it: it uses no process group), and a count
    that a change of its state moves on, so that a computation ahead not started yet never
    starts."""

    def __init__(self) -> None:
        self.token = 0
        self.used = False
        self.running = False


class Stepping(DataPositioned, Protocol):
    """The parts of a `Replica` that its step's local half and a gradient ahead use: its
    model, where its shard is, and the state of its step under way, behind its two locks."""

    model: torch.nn.Module
    committed_step: int
    replica_id: int
    ranks_per_replica: int
    _rank: int
    _stepping: threading.Lock
    _changing: threading.Lock
    _started: StepStart | None
    _computed: int
    _gradient: torch.Tensor | None
    _update: torch.Tensor | None
    _group: Any
    _quorum: int
    _reused: torch.Tensor | None
    _donor: DonorCache
    _ahead: Ahead

    def loss(self, model: torch.nn.Module, step: int, shard: int) -> torch.Tensor: ...

    def on_phase(self, phase: str, step: int) -> None: ...


def begin_step(replica: Stepping, step: int) -> bool:
    """Start `step` on `replica` (a `Replica`, its step lock held): note what the step may
    change (buffers, data position, RNG states), so that an abort puts it back. True if its
    local gradient of `step` is already computed (kept from an aborted attempt, or ahead)."""
    with replica._changing:  # the data and RNG a retry must see again, and the buffers
        if replica._update is not None and replica._reused is None:  # an exchange done, of
            replica._reused = replica._update  # this step asked again (`_inflight`): its memory
        replica._update = None
        if replica._computed == step and replica._started is not None:
            return True
        undo_step(replica)  # an attempt that failed before its gradient
        if next(replica.model.buffers(), None) is not None:
            replica._donor.clear()  # the forward pass may change buffers lent to a heal
        replica._started = StepStart(save_buffers(replica.model), capture_position(replica))
    return False


def compute_gradient(replica: Stepping, step: int) -> None:
    """The forward and backward passes of `step` on this rank's shard (after `begin_step`)."""
    shard = replica.replica_id * replica.ranks_per_replica + replica._rank
    replica.on_phase("forward", step)
    loss = replica.loss(replica.model, step, shard)
    replica._gradient = local_gradient(replica.model, loss, replica._gradient)
    replica._computed = step


def undo_step(replica: Stepping) -> None:
    """Put back what the step under way changed (with `_changing` held)."""
    if replica._started is not None:
        replica._donor.clear()
        restore_buffers(replica.model, replica._started.buffers)
        restore_position(replica, replica._started.position)
        replica._started = None


class AheadPlan:
    """The gradient ahead of one replacement's rejoin: `after_warm_up` runs on the thread
    that warms the replacement up (holding its step lock, so no step can begin before it),
    waits for the catch-up to end (`caught_up`, or `given_up` if it failed), then computes."""

    def __init__(self, replica: Stepping, rank: int) -> None:
        self._replica = replica
        self._rank = rank
        self._ended = threading.Event()
        self._go = False
        self._token = replica._ahead.token
        replica._ahead.used = True

    def keep_gradient(self, memory: torch.Tensor) -> None:
        """Take `memory` (zeroed, faulted in) for the gradient, unless a gradient of a step
        under way is kept: replaced, the step would exchange zeros."""
        if not self._replica._computed:
            self._replica._gradient = memory

    def caught_up(self) -> None:
        self._go = True
        self._ended.set()

    def given_up(self) -> None:
        self._ended.set()

    def after_warm_up(self) -> None:
        replica = self._replica
        if not self._ended.wait(AHEAD_WAIT_S) or not self._go:
            return
        with replica._changing:
            idle = replica._started is None and replica._update is None
            if self._token != replica._ahead.token or not idle or replica._computed:
                return
        step, replica._rank, replica._ahead.running = replica.committed_step + 1, self._rank, True
        try:
            begin_step(replica, step)
            compute_gradient(replica, step)
        except Exception as exc:  # `prepare` computes it again, and raises it to the group
            get_logger("recovery.replica").info("gradient_ahead_failed", error=repr(exc))
        finally:
            replica._ahead.running = False


def leave_steps(replica: Stepping) -> None:
    """Before a heal replaces `replica`'s state: end its part in every step so far. A rank
    lives on, with its actor, when another rank of its replica dies, and its prepare of the
    discarded step may begin or end after the heal began (on a loaded machine), keeping a
    gradient that the retry would exchange. So a prepare under way ends first (its group was
    given up before the heal was asked for), a later one of an older quorum is refused (no
    group), and what a step left is dropped: a gradient kept or computed ahead, an average,
    what its passes changed."""
    with replica._stepping, replica._changing:
        replica._ahead.token += 1
        replica._group, replica._quorum = None, -1
        replica._update, replica._computed = None, 0
        undo_step(replica)


def drop_ahead(replica: Stepping) -> None:
    """Before a change of `replica`'s state outside a step (a catch-up, a heal): a gradient
    computed ahead is dropped and what its passes changed put back; one not started yet will
    not start. Does nothing on a replica that never computed ahead (a spare)."""
    if not replica._ahead.used:
        return
    with replica._stepping, replica._changing:
        replica._ahead.token += 1
        if replica._update is None and replica._started is not None:
            replica._computed = 0
            undo_step(replica)
