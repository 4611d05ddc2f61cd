"""How a spare replica follows its group: the committed updates a replica keeps, and catching
up by applying a peer's (`_prefetch` fetches and applies them).

Every participant of a step ends `prepare` with the averaged gradient of the step and applies
it with its optimizer. A spare that holds the state of step s and applies the averaged gradients
of steps s+1..t, in order, with the same optimizer, holds the state of step t bit for bit, at
the cost of one gradient's bytes per step instead of the whole state. So with spares, every
replica keeps the averaged gradients of its last `Replica.standby_updates` committed steps
(`UpdateLog`), and a spare pulls the ones it lacks from a live peer (`fetch_updates`).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from supervision import ActorError, SupervisionError
from transport import Lent, get_logger

from ._heal_state import StateLayout, flat_bytes, memory_of
from ._outcomes import short
from ._position import Position

if TYPE_CHECKING:
    import torch

    from mesh import ActorMesh, Future


@dataclass(frozen=True)
class Takeover:
    """How a spare took a failed replica's place: the step it holds, the committed updates it
    applied to get there, and whether it had to heal its whole state instead."""

    step: int
    updates: int
    healed: bool


#: The nice value a spare applies committed updates at: it runs on the CPU the replicas leave
#: idle, instead of taking its share of theirs (on a machine they fill, a third of a step).
FOLLOW_NICE = 19


class Lowered:
    """The priority of the thread a spare follows its group on: lowered while it applies the
    committed updates, and raised back at once when the spare must take a place (`first`).
    Only where this process may raise a thread's priority back (CAP_SYS_NICE, or an
    RLIMIT_NICE that allows it): elsewhere a spare follows at its normal priority."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy = threading.Lock()  # held by the follow under way
        self._thread: tuple[int, int] | None = None  # lowered: (native id, its own nice value)
        self._waiting = 0  # take-overs waiting for the follow under way
        self.enabled = may_raise_priority()

    @contextmanager
    def following(self, lower: bool = True) -> Iterator[None]:
        """The calling thread runs at `FOLLOW_NICE` inside if `lower` (and no take-over
        waits), at its own priority after."""
        with self._busy:
            thread = threading.get_native_id()
            own = os.getpriority(os.PRIO_PROCESS, thread)
            with self._lock:
                if self.enabled and lower and not self._waiting:
                    os.setpriority(os.PRIO_PROCESS, thread, max(own, FOLLOW_NICE))
                    self._thread = (thread, own)
            try:
                yield
            finally:
                self._raise()

    @contextmanager
    def first(self) -> Iterator[None]:
        """Inside: no follow runs. A follow under way goes on at its own priority, and is
        waited for (a take-over must not wait for a thread the replicas' CPU starves)."""
        with self._lock:
            self._waiting += 1
        try:
            self._raise()
            with self._busy:
                yield
        finally:
            with self._lock:
                self._waiting -= 1

    @property
    def awaited(self) -> bool:
        """Whether a take-over waits for the follows (`first`): they skip their checks, which
        the take-over makes once it holds the step it takes over at."""
        return self._waiting > 0

    def hurry(self) -> None:
        """A follow under way goes on at its own priority (the spare lags)."""
        self._raise()

    def _raise(self) -> None:
        """The lowered thread back to its own priority, and the threads it started meanwhile
        (they inherited its low priority, and may serve the replica later)."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            for name in os.listdir("/proc/self/task"):
                try:
                    if os.getpriority(os.PRIO_PROCESS, int(name)) == FOLLOW_NICE != thread[1]:
                        os.setpriority(os.PRIO_PROCESS, int(name), thread[1])
                except ProcessLookupError:
                    pass  # it ended meanwhile


def may_raise_priority() -> bool:
    """Whether this process may give a thread whose nice value it raised to `FOLLOW_NICE`
    its own back: with CAP_SYS_NICE, or an RLIMIT_NICE reaching this process's nice value."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_NICE)[0]
    own = os.getpriority(os.PRIO_PROCESS, 0)
    if limit == resource.RLIM_INFINITY or 20 - own <= limit:
        return True
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            effective = next(line for line in status if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    return bool(int(effective.split()[1], 16) >> 23 & 1)  # CAP_SYS_NICE


class UpdateLog:
    """The averaged gradients of the last `keep` committed steps (none when `keep` is 0).
    Read by a concurrent endpoint while the replica steps: guarded by a lock. An update that
    falls out of the log is handed back for the next step's exchange to write into, once no
    lend of it is still read by the transport (a fresh gradient's memory costs a page fault
    per page: about a third of a 100 MB model's step)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._updates: deque[_Kept] = deque(maxlen=1)
        self._provided: list[torch.Tensor] = []  # memory for the updates while the log fills
        self.keep = 0

    def resize(self, keep: int) -> None:
        if type(keep) is not int or keep < 0:
            raise ValueError(f"a replica keeps a whole number of updates >= 0, not {keep!r}")
        with self._lock:
            pool = max(keep, self.keep)
            left = list(self._updates)[: max(len(self._updates) - keep, 0)]
            self.keep = keep
            self._updates = deque(self._updates if keep else (), maxlen=max(keep, 1))
            # the memory of updates that leave the log (none lent) is kept for when it fills
            # again: a group keeps updates only while a replacement is on its way
            self._provided += [entry.tensor for entry in left if not entry.lends]
            del self._provided[pool:]

    def provide(self, memory: list[torch.Tensor]) -> None:
        """Memory (written once already: no page faults left) that `record` hands out while
        the log fills, instead of nothing: at 1 GB, each of the first `keep` steps of a replica
        of a group with spares exchanged into a fresh gradient (82 thousand page faults)."""
        with self._lock:
            self._provided = list(memory[: self.keep])

    def record(self, step: int, update: torch.Tensor) -> torch.Tensor | None:
        """Keep the update of committed `step` (the step after the last one kept). Returns
        memory no one reads any more, for the next update: `update` itself if none are kept,
        the update that fell out of the log if no lend of it is still being sent, memory
        `provide`d while the log fills, else None."""
        with self._lock:
            if not self.keep:
                return update
            if self._updates and self._updates[-1].step != step - 1:
                self._updates.clear()  # a gap (this replica healed meanwhile): start afresh
            full = len(self._updates) == self._updates.maxlen
            dropped = self._updates[0] if full else None
            self._updates.append(_Kept(step, update))
            if dropped is None and self._provided:
                return self._provided.pop()
        # no new lend of `dropped` can start: it is out of the log
        return dropped.tensor if dropped is not None and not dropped.lends else None

    def between(self, first: int, last: int) -> list[torch.Tensor] | None:
        """The updates of steps `first`..`last`, or None unless all of them are kept."""
        kept = self._kept(first, last)
        return None if kept is None else [entry.tensor for entry in kept]

    def lend(self, first: int, last: int, span: tuple[int, int] | None = None) -> list[Any] | None:
        """`between` (elements `span` of each, if given), each update sent from this
        replica's memory (no copy): a kept update is not written again until it has left the
        log and every lend of it was sent."""
        kept = self._kept(first, last, lending=True)
        if kept is None:
            return None
        return [LentUpdate(entry, span) if entry.tensor.nbytes else entry.tensor for entry in kept]

    def _kept(self, first: int, last: int, lending: bool = False) -> list[_Kept] | None:
        if not (type(first) is int and type(last) is int and 1 <= first <= last):
            raise ValueError(f"ask for the updates of steps first..last >= 1, not {first}..{last}")
        with self._lock:
            found = {entry.step: entry for entry in self._updates}
            if first not in found or last not in found:
                return None
            kept = [found[step] for step in range(first, last + 1)]
            for entry in kept if lending else ():
                if entry.tensor.nbytes:  # (an empty one goes as it is)
                    entry.lends.append(None)  # before the lock goes: `record` sees it lent
        return kept


class _Kept:
    """A kept update, and one item in `lends` for each lend of it the transport may still
    read (list appends and pops are atomic: a lend ends in whatever thread frees it)."""

    __slots__ = ("lends", "step", "tensor")

    def __init__(self, step: int, tensor: torch.Tensor) -> None:
        self.step, self.tensor = step, tensor
        self.lends: list[None] = []


class _LendEnd:
    """Ends one lend of a kept update when the last holder of it (the `LentUpdate`, or the
    memory view the transport sends) lets it go."""

    __slots__ = ("lends",)

    def __init__(self, lends: list[None]) -> None:
        self.lends = lends

    def __del__(self) -> None:
        self.lends.pop()


class LentUpdate:
    """A committed update lent to the transport (`transport.Lent`); received, it is a flat
    tensor over the received bytes (no copy on either side)."""

    __slots__ = ("end", "tensor")

    def __init__(self, kept: _Kept, span: tuple[int, int] | None = None) -> None:
        self.tensor = kept.tensor if span is None else kept.tensor[span[0] : span[1]]
        self.end = _LendEnd(kept.lends)

    def __reduce__(self) -> tuple[Any, ...]:
        dtype = str(self.tensor.dtype).removeprefix("torch.")
        raw = flat_bytes(self.tensor)
        raw._lend_end = self.end  # type: ignore[attr-defined]  # kept by the memory view
        return _received_update, (Lent(memory_of(raw)), dtype)


def _received_update(buffer: Any, dtype: str) -> torch.Tensor:
    import torch

    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise ValueError(f"a committed update names no torch dtype: {dtype!r}")
    return torch.frombuffer(memoryview(buffer).cast("B"), dtype=kind)


def warm_up_gloo() -> None:
    """Make and drop a one-rank gloo process group. A process's first one costs ~0.25 s of
    gloo's own set-up (~0.01 s after that): a spare pays it here, not in the rendezvous of the
    step it joins, where every replica would wait for it."""
    import datetime

    import torch.distributed as dist

    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=30))  # type: ignore[attr-defined]


def warm_up_autograd(model: torch.nn.Module) -> None:
    """Two backward passes through the parameters alone, into a throwaway gradient (no forward
    of the model: nothing of its state or data changes). A process's first backward passes cost
    ~10-20 ms more than later ones: a spare pays that here, not in the first step it joins."""
    from ._arithmetic import local_gradient

    trainable = [param for param in model.parameters() if param.requires_grad]
    flat = None
    for _ in range(2 if trainable else 0):
        squares = [(param * param).sum() for param in trainable]
        flat = local_gradient(model, sum(squares[1:], squares[0]), flat)
    for param in model.parameters():
        param.grad = None


def rank_match(mesh: ActorMesh[Any], rank: int) -> ActorMesh[Any]:
    """The rank of a replica's actor `mesh` that serves this replica's rank `rank`."""
    ranks = mesh.flatten("rank")
    return ranks.slice(rank=rank % len(ranks))


def fetch_updates(
    peers: Sequence[ActorMesh[Any]],
    first: int,
    last: int,
    numel: int,
    timeout_s: float,
    span: tuple[int, int] | None = None,
) -> list[torch.Tensor] | None:
    """The committed updates of steps `first`..`last` (elements `span` of each, if given:
    `numel` is then its length) from the first of `peers` (one rank each) that keeps them
    all, or None if none does (it died, or no longer keeps them)."""
    args = (first, last) if span is None else (first, last, span)
    for peer in peers:
        try:
            updates = peer.committed_updates.call_one(*args).get(timeout=timeout_s)
        except (SupervisionError, ActorError, TimeoutError) as exc:
            _log_miss(peer, first, last, short(exc))
            continue
        if updates is not None and _well_formed(updates, last - first + 1, numel):
            return list(updates)
        _log_miss(peer, first, last, "not kept" if updates is None else "malformed")
    return None


def _log_miss(peer: ActorMesh[Any], first: int, last: int, why: str) -> None:
    """Say why a peer did not give the updates a spare asked for (it is healed whole then)."""
    get_logger("recovery.spares").warning(
        "updates_not_fetched", peer=peer.name, first=first, last=last, reason=why
    )


def _well_formed(updates: Any, count: int, numel: int) -> bool:
    import torch

    return (
        isinstance(updates, list)
        and len(updates) == count
        and all(
            isinstance(u, torch.Tensor) and u.dim() == 1 and u.numel() == numel for u in updates
        )
    )


def peer_position(
    peers: Sequence[ActorMesh[Any]], step: int, timeout_s: float, asked: Future[Any] | None = None
) -> Position | None:
    """The data position and RNG states of the first of `peers` (one rank each) that holds
    committed `step`, or None if none does; `asked`: the first peer's `heal_layout` call,
    made already."""
    for index, peer in enumerate(peers):
        try:
            call = asked if index == 0 and asked is not None else peer.heal_layout.call_one()
            layout = call.get(timeout=timeout_s)
        except (SupervisionError, ActorError, TimeoutError):
            continue
        if isinstance(layout, StateLayout) and layout.step == step:
            return layout.position
    return None
