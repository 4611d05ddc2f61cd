"""The gradient exchange of a replica group: a reduce-scatter then an all-gather, in fixed order.

The flat gradient is cut into one bucket per group rank. An all-to-all (of uneven parts where
the size does not divide: the gradient itself is sent, not a padded copy) sends bucket b of
every rank to its owner, rank b, which sums the parts in rank order and
divides; an all-gather then hands every rank every averaged bucket. Each rank sends and
receives about twice the gradient's size whatever the number of replicas (an all-gather of
whole gradients moves N times that; it is still used for small gradients, where latency
counts more than bytes). Float addition is elementwise, so summing a bucket in
rank order gives the bits that summing whole gradients in rank order gives: `average` is the
reference, which `replay_training` uses.

The collectives are methods of the backend's process group (`alltoall_base`,
`_allgather_base`): gloo on CPU; NCCL offers the same methods for CUDA tensors (untested here:
no GPU). Every wait goes through `wait_unless_aborted`, so a survivor gives up as soon as
supervision says a peer is dead instead of waiting for the backend's timeout.

A replica's process groups are made here too: a step's (`open_group`), and the standing ones
of take-overs (`form_groups`), which `HeldGroups` forms beside the steps and hands to them.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from transport import Addresses

from ._aborts import AbortWatch, quorum_prefix, store_client
from ._native import leaving, native_call
from ._outcomes import ExchangeAborted

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

#: How often a waiting replica looks for an abort: it bounds what a survivor waits beyond the
#: moment supervision reports a death.
ABORT_POLL_S = 0.02


#: Below this many bytes sent per rank, one all-gather of whole gradients costs less than two
#: collectives (latency, not bandwidth, bounds a step): the bits are the same either way.
ALLGATHER_BELOW_BYTES = 256 * 1024

#: A large gradient is exchanged in segments of this size, pipelined: gloo moves several
#: smaller collectives faster than one large one, and the averaging of a segment overlaps the
#: transfer of the next. Float addition is elementwise, so segments change no bits. Each
#: segment costs two collectives, their system calls and a wake-up of the replica's thread:
#: at 336 MB on 3 ranks, 16 MiB took a fifth less CPU than 4 MiB (docs/replica-recovery.md).
SEGMENT_BYTES = 16 << 20

#: Segments in flight at once; their buffers are reused for the segments after them. At
#: 16 MiB, 2 and 4 in flight cost the same CPU here; wall times moved with the load.
WINDOW = 4

#: One standing group a replica forms (`_standing`): (quorum, its first group rank, world).
GroupPlace = tuple[int, int, int]

#: Process groups with collectives given up, and those collectives: kept until they end, since
#: dropping a process group waits for its pending work (up to the backend's timeout).
_ABANDONED: list[tuple[Any, Any]] = []


def bucket_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """The slice of a flat gradient of `numel` elements that each of `world` ranks owns: equal
    contiguous buckets, in rank order (the last ones shorter, or empty, where it does not
    divide)."""
    if world < 1 or numel < 0:
        raise ValueError(f"buckets need world >= 1 and numel >= 0, not {world} and {numel}")
    size = -(-numel // world)
    return [(min(b * size, numel), min((b + 1) * size, numel)) for b in range(world)]


def average(parts: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of `parts`, summed left to right (participant order): the same bits wherever
    it is computed, a bucket at a time or whole. Written into `out` when given."""
    import torch

    dtypes = {part.dtype for part in parts[:2]} | ({out.dtype} if out is not None else set())
    first = 2 if len(parts) > 1 and len(dtypes) == 1 else 1
    if first == 2:  # the first sum written straight into `total`: one pass over memory less
        total = torch.add(parts[0], parts[1], out=out) if out is not None else parts[0] + parts[1]
    else:
        total = parts[0].clone() if out is None else out.copy_(parts[0])
    for part in parts[first:]:
        total += part
    total /= len(parts)
    return total


def exchange_average(
    group: Any,
    local: torch.Tensor,
    aborted: Callable[[], str | None],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The average of every group rank's `local` gradient (bitwise `average` of them in rank
    order), through `group`; raises `ExchangeAborted` once `aborted()` names a reason. The
    result is written into `out` if it fits (memory reused from step to step: a fresh gigabyte
    costs a page fault per page); `out` must not be used again after `ExchangeAborted`, since
    the collectives given up may still write into it."""
    import torch

    _ABANDONED[:] = [(g, work) for g, work in _ABANDONED if not work.is_completed()]
    world, numel = group.size(), local.numel()
    result = out if out is not None and _fits(out, local) else None
    if world == 1:
        return average([local], result)
    if (world - 1) * numel * local.element_size() < ALLGATHER_BELOW_BYTES:
        everyone = torch.empty(world * numel, dtype=local.dtype, device=local.device)
        _wait_for(group, group._allgather_base(everyone, local.contiguous()), aborted)
        return average(everyone.view(world, numel).unbind(0), result)
    if result is None:
        result = torch.empty(numel, dtype=local.dtype, device=local.device)
    _reduce_scatter_all_gather(group, local.contiguous().view(-1), aborted, result)
    return result


def _fits(out: torch.Tensor, local: torch.Tensor) -> bool:
    return (out.shape, out.dtype, out.device) == ((local.numel(),), local.dtype, local.device)


def segment_bounds(numel: int, world: int, element_size: int) -> list[tuple[int, int]]:
    """The segments a gradient of `numel` elements is exchanged in: `SEGMENT_BYTES` each (a
    multiple of `world` elements, so that their buckets need no padding), the last shorter."""
    per = max(world, SEGMENT_BYTES // element_size // world * world)
    return [(start, min(start + per, numel)) for start in range(0, numel, per)]


def _reduce_scatter_all_gather(
    group: Any, local: torch.Tensor, aborted: Callable[[], str | None], result: torch.Tensor
) -> None:
    """Segment by segment, pipelined, `WINDOW` segments in flight: as each segment's
    all-to-all arrives, its buckets are averaged, its all-gather started straight into
    `result`, and the all-to-all of a later segment started into the buffers it freed (the
    same few buffers all along: no page faults, data that stays in cache)."""
    world, rank = group.size(), group.rank()
    segments = segment_bounds(local.numel(), world, local.element_size())
    buffers = _Buffers.reused(local, segments[0][1] - segments[0][0], world, len(segments))
    works: list[Any] = []
    try:
        scattered = [
            _scatter(group, local, segments[i], buffers.received[i], rank, works)
            for i in range(len(buffers.received))
        ]
        gathers: list[tuple[Any, torch.Tensor, int, int]] = []
        for index, (a, b) in enumerate(segments):
            work, received, (start, stop) = scattered[index]
            wait_unless_aborted(work, aborted)
            slot = index % len(buffers.received)
            if index >= len(buffers.received):  # its bucket buffer is read by that all-gather
                wait_unless_aborted(gathers[index - len(buffers.received)][0], aborted)
            share = -(-(b - a) // world)
            averaged = buffers.averaged[slot][:share]
            average(received.view(world, stop - start).unbind(0), averaged[: stop - start])
            averaged[stop - start :].zero_()
            out = result[a:b] if share * world == b - a else buffers.empty(share * world)
            works.append(group._allgather_base(out, averaged))
            gathers.append((works[-1], out, a, b))
            later = index + len(buffers.received)
            if later < len(segments):
                scattered.append(
                    _scatter(group, local, segments[later], buffers.received[slot], rank, works)
                )
        for work, out, a, b in gathers[-len(buffers.received) :]:
            wait_unless_aborted(work, aborted)
            if out.data_ptr() != result[a:b].data_ptr():
                result[a:b] = out[: b - a]
        _SPARE_BUFFERS[:] = [buffers]  # no collective writes them any more: the next one's
    except BaseException:  # (given up: collectives may still write the buffers, left to them)
        _ABANDONED.extend((group, work) for work in works if not work.is_completed())
        raise


class _Buffers:
    """The memory of the segments in flight: where each all-to-all receives and where its
    averaged bucket waits for its all-gather (a padded last segment is gathered aside)."""

    def __init__(self, local: torch.Tensor, per: int, world: int, segments: int) -> None:
        self._dtype, self._device = local.dtype, local.device
        slots, share = min(WINDOW, segments), -(-per // world)
        self.shape = (local.dtype, local.device, slots, share, world)
        self.received = [self.empty(share * world) for _ in range(slots)]
        self.averaged = [self.empty(share) for _ in range(slots)]

    @classmethod
    def reused(cls, local: torch.Tensor, per: int, world: int, segments: int) -> _Buffers:
        """The buffers the last exchange that ended left (`_SPARE_BUFFERS`), if they have the
        shape needed, else fresh ones: fresh memory costs a page fault per 4 KiB page, and
        glibc's heap often fails to hand back the memory of tensors freed (85 MiB a step,
        at 3 ranks: up to 12 thousand page faults in one exchange, measured at 100 MB)."""
        try:
            spare: _Buffers | None = _SPARE_BUFFERS.pop()  # one exchange takes them
        except IndexError:
            spare = None
        slots, share = min(WINDOW, segments), -(-per // world)
        if spare is not None and spare.shape == (local.dtype, local.device, slots, share, world):
            return spare
        return cls(local, per, world, segments)

    def empty(self, numel: int) -> torch.Tensor:
        import torch

        return torch.empty(numel, dtype=self._dtype, device=self._device)


#: The segment buffers of the last exchange that ended well, for the next (one set).
_SPARE_BUFFERS: list[_Buffers] = []


def _scatter(
    group: Any,
    local: torch.Tensor,
    segment: tuple[int, int],
    buffer: torch.Tensor,
    rank: int,
    works: list[Any],
) -> tuple[Any, torch.Tensor, tuple[int, int]]:
    """Start the all-to-all of one segment of `local`, received into `buffer`: bucket b of it
    to rank b (uneven where the size does not divide: the segment itself is sent, not a padded
    copy). Returns its work, where it lands and this rank's bucket of the segment."""
    import torch.distributed as dist

    world = group.size()
    bounds = bucket_bounds(segment[1] - segment[0], world)
    mine = bounds[rank][1] - bounds[rank][0]
    received = buffer[: world * mine]
    sizes = [b - a for a, b in bounds]
    options = dist.AllToAllOptions()  # type: ignore[attr-defined]
    sent = local[segment[0] : segment[1]]
    works.append(group.alltoall_base(received, sent, [mine] * world, sizes, options))
    return works[-1], received, bounds[rank]


def wait_unless_aborted(work: Any, aborted: Callable[[], str | None]) -> None:
    """Wait for a collective's `work`; give it up (it goes on, abandoned, until the backend's
    timeout) as soon as `aborted()` gives a reason. The backend waits in slices of
    `ABORT_POLL_S` (a timed-out ``wait`` leaves gloo's work running, to be waited on again)."""
    poll = datetime.timedelta(seconds=ABORT_POLL_S)
    with native_call():
        while True:
            try:
                work.wait(poll)
                return
            except RuntimeError:
                if work.is_completed():
                    work.wait()  # it failed: raises the backend's error
                    return
            _give_up_if(aborted)


def _wait_for(group: Any, work: Any, aborted: Callable[[], str | None]) -> None:
    try:
        wait_unless_aborted(work, aborted)
    except ExchangeAborted:
        _ABANDONED.append((group, work))
        raise


def open_group(
    store: Addresses, quorum: int, rank: int, world: int, timeout_s: float, aborts: Any
) -> Any:
    """The gloo process group of `quorum` (a fresh one per membership), as group rank `rank`
    of `world`, through the group's store at `store`. Gives up as soon as `aborts()` names
    a reason (`ExchangeAborted`): a member failed while the others waited for it."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    # A store client of its own: an abandoned rendezvous may still use its connection.
    client = store_client(store, timeout_s)

    def rendezvous() -> Any:
        try:
            prefixed = dist.PrefixStore(quorum_prefix(quorum), client)  # type: ignore[attr-defined]
            return dist.ProcessGroupGloo(prefixed, rank, world, timeout)  # type: ignore[attr-defined]
        finally:  # the group needs the store no more (and a Python store must be kept alive
            client.close()  # by Python while torch uses it: `client`, here, until this ends)

    return run_unless_aborted(rendezvous, aborts)


def run_unless_aborted(task: Callable[[], T], aborted: Callable[[], str | None]) -> T:
    """`task()` (a blocking call such as a process group's rendezvous) on a thread of its own,
    given up (left to end on its own) as soon as `aborted()` gives a reason."""
    done = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        try:
            with native_call():
                outcome.append((True, task()))
        except BaseException as exc:
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="meshvisor-rendezvous", daemon=True).start()
    _wait(done, aborted)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _wait(done: threading.Event, aborted: Callable[[], str | None]) -> None:
    with native_call():  # `aborted` asks the store: a native call too
        while not done.wait(ABORT_POLL_S):
            _give_up_if(aborted)


def _give_up_if(aborted: Callable[[], str | None]) -> None:
    """Raise `ExchangeAborted` if `aborted()` gives a reason or the process is exiting."""
    reason = "the process is exiting" if leaving() else aborted()
    if reason is not None:
        raise ExchangeAborted(f"the exchange was given up: {reason}")


def form_groups(
    held: dict[int, Any],
    groups: Sequence[GroupPlace],
    rank: int,
    store: Addresses,
    timeout_s: float,
) -> dict[int, Any]:
    """The standing groups a replica's rank `rank` holds after forming `groups` (quorum, first
    group rank, world; base -1: one of `held`, already formed), in quorum order (every
    participant forms them in the same order: no rendezvous waits on another). Groups of
    `held` not listed are dropped."""
    kept = {quorum: held[quorum] for quorum, base, _ in groups if base < 0 and quorum in held}
    new = sorted(group for group in groups if group[1] >= 0)
    watch = AbortWatch(store, timeout_s)
    for quorum, base, world in new:
        watch.quorum = quorum
        if watch() is not None:  # the controller gave this formation up: nobody else comes
            continue
        try:
            group = open_group(store, quorum, base + rank, world, timeout_s, watch)
            wait_unless_aborted(group.barrier(), watch)  # its first collective costs more
            kept[quorum] = group
        except ExchangeAborted:
            continue  # a participant failed: the controller drops this group too
        except Exception as exc:  # the formation failed: its other participants stop waiting
            for later, _, _ in new:
                watch.abort(later, f"a participant could not form it: {type(exc).__name__}")
            raise
    return kept


class HeldGroups:
    """A replica's standing groups, by quorum (`_standing`): formed on the thread of a
    `stand_by` call while the replica steps (one formation at a time), taken by `prepare`.
    The step never waits for a formation: it holds the lock of the groups only to take one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._forming = threading.Lock()  # never taken by a step
        self._groups: dict[int, Any] = {}
        self._retired: list[Any] = []  # groups left for a standing one
        self.watch: AbortWatch | None = None  # for a replica entering one before any `join`

    def form(
        self, groups: Sequence[GroupPlace], rank: int, store: Addresses, timeout_s: float
    ) -> list[int]:
        """Keep the held groups `groups` lists (base -1), drop the others and the retired ones
        (dropping one takes ~10 ms: here, off the step), form the new ones (`form_groups`).
        Returns the quorums of the groups it formed."""
        with self._forming:
            listed = {quorum for quorum, _, _ in groups}
            with self._lock:
                dropped = [g for q, g in self._groups.items() if q not in listed] + self._retired
                self._groups = {q: g for q, g in self._groups.items() if q in listed}
                self._retired = []
            del dropped
            if self.watch is None:
                self.watch = AbortWatch(store, timeout_s)
            formed = form_groups({}, groups, rank, store, timeout_s)
            with self._lock:
                self._groups.update(formed)
            return sorted(formed)

    def take(self, quorum: int, current: Any) -> Any | None:
        """The group of `quorum`, no longer held, or None if none is held; `current` (the
        group it replaces) is dropped by the next formation."""
        with self._lock:
            group = self._groups.pop(quorum, None)
            if group is not None:
                self._retired.append(current)
            return group
