"""`Manager`: fault tolerance for a training loop you wrote yourself (TorchFT's Manager shape).

Inside a loop that `LoopGroup` runs in each replica::

    manager = recovery.Manager(model, optimizer, data_state=..., load_data_state=...)
    for step in manager.steps(100):      # quorum for each step; a replacement heals first
        loss = loss_fn(model(batch()), ...)
        optimizer.zero_grad()
        loss.backward()
        manager.allreduce_gradients()    # average over the step's replicas, fixed order
        if manager.should_commit():      # every replica's exchange succeeded
            optimizer.step()

A step that a replica's failure spoils is discarded everywhere: `should_commit()` says no,
puts the data position and RNG states back as they were before the step, and the next
iteration retries it with the replicas that are up. The optimizer changes the state only after
a yes, so every replica holds the committed state whenever it waits for the next step; that is
when its runner serves the heals of replacements.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from mesh import Channel

from ._aborts import AbortWatch
from ._arithmetic import flatten_gradients, use_average
from ._exchange import exchange_average, open_group
from ._heal import HealReport, endpoints_of, heal
from ._heal_donor import DonorCache, Stale
from ._heal_state import Chunk, Piece, StateLayout
from ._loop_protocol import (
    Answer,
    AskQuorum,
    Decision,
    Envelope,
    Finished,
    Go,
    Healed,
    HealFrom,
    Reply,
    Request,
    Vote,
)
from ._loop_runner import current_loop
from ._outcomes import ExchangeAborted, short
from ._position import Position, capture_position, restore_position

if TYPE_CHECKING:
    import torch


class Manager:
    """Quorum, gradient exchange, commit decision and heal for one replica's own loop."""

    #: Healing moves the state in chunks of this many bytes, this many in flight per peer.
    heal_chunk_bytes: int = 8 << 20
    heal_window: int = 4
    heal_timeout_s: float = 60.0

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        data_state: Callable[[], Any] | None = None,
        load_data_state: Callable[[Any], None] | None = None,
    ) -> None:
        loop = current_loop()
        self.model, self.optimizer = model, optimizer
        self.committed_step = 0
        self.replica_id = loop.spec.replica
        self.incarnation = loop.spec.incarnation
        self.last_heal: HealReport | None = None
        self._spec = loop.spec
        self._data_state, self._load_data_state = data_state, load_data_state
        self._answers_port, self._answers = Channel[Reply].open()
        self._seq = 0
        self._aborts = AbortWatch(loop.spec.store, loop.spec.group_timeout_s)
        self._group: Any = None
        self._go: Go | None = None  # the step in progress
        self._error: str | None = None  # why this step cannot be committed
        self._position: Position | None = None
        self._at_boundary = False  # waiting for a step, or done: the state stays put
        self._donor = DonorCache()
        self._flat: torch.Tensor | None = None  # the flat gradient, reused each step
        loop.attach(self)

    # -- the loop ----------------------------------------------------------------------------

    def steps(self, until: int) -> Iterator[int]:
        """The steps to train, up to `until`: each is attempted (again, if discarded) until
        committed. Each iteration must end with `should_commit()`."""
        if type(until) is not int or until < 0:
            raise ValueError(f"Manager.steps() needs a step count >= 0, not {until!r}")
        while self.committed_step < until and self._start_step(until):
            assert self._go is not None
            yield self._go.step
            if self._go is not None:
                raise RuntimeError(
                    f"step {self._go.step} ended without manager.should_commit(): call it "
                    "after the gradients are exchanged, and step the optimizer only if it "
                    "says yes"
                )
        self._at_boundary = True

    def current_step(self) -> int:
        """The number of steps committed so far."""
        return self.committed_step

    @property
    def participants(self) -> tuple[int, ...]:
        """The replicas training the step in progress."""
        return self._go.members if self._go is not None else ()

    def allreduce_gradients(self) -> None:
        """Replace the gradient of every trainable parameter with its average over the step's
        replicas (a parameter without one counts as zeros). The gradients travel as one flat
        tensor, the same memory every step; the averaged ones are views of the result."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        self._flat = flatten_gradients(params, self._flat)
        use_average(params, self.exchange(self._flat))

    def exchange(self, tensor: torch.Tensor) -> torch.Tensor:
        """The average of `tensor` (flat, the same size everywhere) over the step's replicas,
        summed in replica order: the same bits everywhere. Should a replica fail, this returns
        `tensor` as it is and `should_commit()` will say no."""
        go = self._in_step("exchange")
        if self._error is not None or go.world == 1:
            return tensor
        try:
            return exchange_average(self._group, tensor.reshape(-1), self._aborts).view_as(tensor)
        except (ExchangeAborted, RuntimeError) as exc:
            self._error = f"the exchange failed: {short(exc)}"
            return tensor

    def should_commit(self) -> bool:
        """Whether every replica of the step exchanged its gradients: then step the optimizer.
        No: the step is discarded; the data position and RNG states are back as before it."""
        go = self._in_step("should_commit")
        ok, why = self._error is None, self._error or ""
        decision = self._ask(Vote(self.replica_id, self.incarnation, go.quorum, go.step, ok, why))
        self._go = None
        if isinstance(decision, Decision) and decision.commit:
            self.committed_step = go.step
            self._position = None
            return True
        assert self._position is not None
        restore_position(self, self._position)
        self.model.zero_grad(set_to_none=True)
        self._group = None  # the next step forms a new process group
        return False

    # -- data position (what `_position` captures and a heal carries) ------------------------

    def data_state(self) -> Any:
        return self._data_state() if self._data_state is not None else None

    def load_data_state(self, state: Any) -> None:
        if self._load_data_state is not None:
            self._load_data_state(state)

    # -- serving heals (the runner's endpoints, on another thread) ---------------------------

    def donor_layout(self) -> StateLayout:
        return self._donor.layout(self, prepared=not self._at_boundary)

    def donor_chunks(self, step: int, pieces: Sequence[Piece]) -> list[Chunk] | Stale:
        return self._donor.chunks(self, step, pieces, prepared=not self._at_boundary)

    # -- inside -------------------------------------------------------------------------------

    def _start_step(self, until: int) -> bool:
        """Wait for the next step's group (healing first if told to); False: the run is over."""
        self._donor.clear()  # the optimizer may have replaced its tensors since
        self._at_boundary = True
        try:
            answer = self._ask(
                AskQuorum(self.replica_id, self.incarnation, self.committed_step, until)
            )
            while not (isinstance(answer, Go) and self._enter(answer)):
                if isinstance(answer, Finished):
                    return False
                if isinstance(answer, HealFrom):
                    answer = self._ask(self._heal(answer))
                    continue
                answer = self._ask(
                    AskQuorum(self.replica_id, self.incarnation, self.committed_step, until)
                )
        finally:
            self._at_boundary = False
        self._go, self._error = answer, None
        self._position = capture_position(self)
        return True

    def _heal(self, order: HealFrom) -> Healed:
        donors = [endpoints_of(runner) for runner in order.donors]
        try:
            self.last_heal = heal(
                self, donors, self.heal_chunk_bytes, self.heal_window, self.heal_timeout_s
            )
        except Exception as exc:
            return Healed(self.replica_id, self.incarnation, self.committed_step, False, short(exc))
        self._group = None
        return Healed(self.replica_id, self.incarnation, self.committed_step, True)

    def _enter(self, go: Go) -> bool:
        """Join the process group of `go` unless this loop is in it already."""
        if self._group is not None and self._aborts.quorum == go.quorum:
            return True
        self._group = None
        self._aborts.quorum = go.quorum
        if go.world == 1:
            return True
        try:
            self._group = open_group(
                self._spec.store,
                go.quorum,
                go.rank,
                go.world,
                self._spec.group_timeout_s,
                self._aborts,
            )
            return True
        except (ExchangeAborted, RuntimeError) as exc:
            why = f"could not join the process group: {short(exc)}"
            self._ask(Vote(self.replica_id, self.incarnation, go.quorum, go.step, False, why))
            return False

    def _in_step(self, what: str) -> Go:
        if self._go is None:
            raise RuntimeError(
                f"manager.{what}() was called outside a step: call it inside "
                "`for step in manager.steps(n):`, once per step, before should_commit() ends it"
            )
        return self._go

    def _ask(self, request: Request) -> Answer:
        """Send `request` to the group and wait for its answer (bounded)."""
        self._seq += 1
        timeout = self._spec.request_timeout_s
        self._spec.port.send(Envelope(request, self._seq, self._answers_port))
        while True:
            try:
                reply = self._answers.recv().get(timeout=timeout)
            except TimeoutError:
                raise RuntimeError(
                    f"replica {self.replica_id}: the loop group did not answer "
                    f"{type(request).__name__} within {timeout:g} s; is its controller alive?"
                ) from None
            if reply.seq == self._seq:
                return reply.answer
