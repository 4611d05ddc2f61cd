"""The gradient exchange (recovery/_exchange.py): its buckets, its bits, and no stalls.

The exchange must give the bits of `average` (whole gradients summed in rank order), which
`replay_training` uses: for every size and world, bucket by bucket in one process (the data
movement of the all-to-all and the all-gather, simulated), and through real gloo groups of
real procs. A replica killed or hung at any point of a step, the rendezvous included, costs
the survivors the failure-detection time, not the process group's timeout. A process that
exits with gloo calls in flight exits cleanly, not by std::terminate.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import exchange_actors as xa
import pytest
import replica_actors as ra
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh import this_host
from recovery import ReplicaGroup, bucket_bounds, replay_training, segment_bounds
from recovery import fixed_order_average as average
from recovery import parameter_digest as digest
from recovery.testing import StoreClient, StoreServer, combine_digest, digest_part

pytestmark = pytest.mark.timeout(240)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


@given(numel=st.integers(0, 10_000), world=st.integers(1, 64))
def test_buckets_cover_the_gradient_in_rank_order(numel: int, world: int) -> None:
    bounds = bucket_bounds(numel, world)
    assert len(bounds) == world
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds)), "contiguous, in rank order"
    share = -(-numel // world)
    sizes = [stop - start for start, stop in bounds]
    assert all(size <= share for size in sizes), "no bucket is over the equal share"
    assert all(size == share for size in sizes[: numel // share if share else 0])


def test_bad_bucket_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="world >= 1"):
        bucket_bounds(10, 0)


def simulated_exchange(grads: list[torch.Tensor]) -> torch.Tensor:
    """What every rank ends with: bucket b of every rank goes to rank b (all-to-all), which
    averages the parts in rank order; the averaged buckets are then gathered in rank order."""
    world, numel = len(grads), grads[0].numel()
    owned = []
    for start, stop in bucket_bounds(numel, world):
        owned.append(average([g[start:stop] for g in grads]))
    return torch.cat(owned)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    world=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_bucketed_average_has_the_bits_of_the_whole_average(
    shape: list[int], world: int, seed: int
) -> None:
    numel = 1
    for size in shape:
        numel *= size
    grads = [xa.gradient(seed, rank, numel) for rank in range(world)]
    assert torch.equal(bits(simulated_exchange(grads)), bits(average(grads)))


@settings(max_examples=200, deadline=None)
@given(
    numel=st.integers(0, 5 * 2**22),
    world=st.integers(1, 9),
    element_size=st.sampled_from([1, 2, 4, 8]),
)
def test_segments_cover_the_gradient_in_order_without_padding_but_the_last(
    numel: int, world: int, element_size: int
) -> None:
    segments = segment_bounds(numel, world, element_size)
    assert bool(segments) == bool(numel)
    starts, stops = [a for a, _ in segments], [b for _, b in segments]
    assert starts == [0, *stops[:-1]][: len(starts)] and stops[-1:] == [numel][: len(stops)]
    sizes = {b - a for a, b in segments[:-1]}  # all but the last: one size, no padding
    assert len(sizes) <= 1 and all(size % world == 0 for size in sizes)
    assert all(0 < b - a <= max(sizes | {b - a}) for a, b in segments)


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=2), max_size=5),
    parts=st.integers(1, 7),
    piece_bytes=st.sampled_from([4, 1000, 8 << 20]),
    seed=st.integers(0, 2**16),
)
def test_shares_of_a_digest_combine_into_the_whole_digest(
    shapes: list[list[int]], parts: int, piece_bytes: int, seed: int
) -> None:
    """Participants that hash a share each (as with spares) give the digest of the whole
    model, with tensors of one piece or many; a changed bit anywhere changes it."""
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    for index, shape in enumerate(shapes):
        tensor = torch.randn(*shape, generator=generator)
        model.register_parameter(f"p{index}", torch.nn.Parameter(tensor))

    def shared() -> str:
        shares = [digest_part(model, part, parts, piece_bytes) for part in range(parts)]
        return combine_digest(entry for share in shares for entry in share)

    whole = combine_digest(digest_part(model, 0, 1, piece_bytes))
    assert shared() == whole
    if piece_bytes == 8 << 20:
        assert whole == digest(model)
    filled = [p for p in model.parameters() if p.numel()]
    if filled:
        with torch.no_grad():
            filled[-1].view(-1)[-1] += 1
        assert shared() != whole


def test_summing_order_matters_for_these_gradients() -> None:
    """The check above can fail: with these magnitudes, another order gives other bits."""
    grads = [xa.gradient(3, rank, 4096) for rank in range(4)]
    assert not torch.equal(bits(average(grads)), bits(average(grads[::-1])))


def test_gloo_exchange_of_real_procs_has_the_bits_of_the_whole_average() -> None:
    """Small gradients go through one all-gather, larger ones through buckets: both bitwise,
    into fresh memory or into the result of the last exchange (`out`)."""
    store = StoreServer()
    procs = this_host().spawn_procs(per_host={"ranks": 4}, name="exchangers")
    try:
        actors = procs.spawn("exchanger", xa.Exchanger).flatten("rank")
        cases = [(2, 1), (3, 1000), (4, 3), (2, 70_001), (4, 100_003), (3, 2_500_001)]
        cases.append((3, 18_000_001))  # more segments than are in flight: buffers reused
        for world, numel in cases:  # several segments, the last one padded
            ranks = actors.slice(rank=slice(0, world))
            tag = f"w{world}-n{numel}"
            found = ranks.average.call(store.addresses, tag, world, 7, numel).get(60)
            expected = average([xa.gradient(7, rank, numel) for rank in range(world)])
            for value in found.values():
                assert torch.equal(bits(value), bits(expected)), (world, numel)
    finally:
        procs.stop(grace_s=1.0).get(timeout=30)
        store.close()


# -- no stalls --------------------------------------------------------------------------------

#: The process group's own timeout in these tests: a survivor that waited for it would take
#: this long; one that gives up on a supervision report takes about the detection time.
GROUP_TIMEOUT_S = 60.0
#: A generous bound on a discarded step (detection, the abort, the controller's bookkeeping)
#: on a machine whose cores are saturated: far below GROUP_TIMEOUT_S.
STALL_BOUND_S = 20.0


def test_survivors_do_not_wait_on_a_replica_failing_at_any_point(
    groups: list[ReplicaGroup], tmp_path: Path
) -> None:
    plan = {
        1: [(1, "join", "SIGKILL"), (10, "apply", "SIGKILL")],
        2: [(4, "forward", "SIGKILL"), (13, "allreduce", "SIGSTOP")],
        0: [(7, "allreduce", "SIGKILL")],
    }
    group = ReplicaGroup(
        this_host(),
        xa.StallingTrainer,
        plan,
        str(tmp_path),
        replicas=3,
        heartbeat_timeout_s=1.0,
        group_timeout_s=GROUP_TIMEOUT_S,
        step_timeout_s=GROUP_TIMEOUT_S,
    )
    groups.append(group)
    while group.committed_steps < 15:
        if group.committed_steps + 1 in (4, 7, 10, 13):
            group.wait_for_all(timeout=120)
        group.step()
        assert len(group.outcomes) < 40, group.outcomes[-5:]
    discarded = {o.step: round(o.seconds, 3) for o in group.outcomes if not o.committed}
    print(f"\nseconds of each discarded step (group timeout {GROUP_TIMEOUT_S:g} s): {discarded}")
    assert set(discarded) == {1, 4, 7, 13}, group.outcomes  # step 10 was decided: it commits
    assert max(discarded.values()) < STALL_BOUND_S, discarded
    replayed = replay_training(ra.Trainer, group.history)
    live = {d for entries in group.status().values() for _, d in entries}
    assert live == {digest(replayed)}


EXITS_WITH_GLOO_CALLS_IN_FLIGHT = """
import datetime, sys, threading
import torch.distributed as dist
from recovery import ExchangeAborted
from recovery.testing import StoreClient, StoreServer, open_group, wait_unless_aborted

timeout = datetime.timedelta(seconds=30)
store = StoreServer()
address = store.addresses
groups = [None] * 3

def join(rank):
    client = StoreClient(address, 30.0)
    groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("q", client), rank, 3, timeout)

def quietly(task, *args):
    try:
        task(*args)
    except ExchangeAborted as exc:
        assert "the process is exiting" in str(exc), exc

joins = [threading.Thread(target=join, args=(rank,)) for rank in range(3)]
for thread in joins:
    thread.start()
for thread in joins:
    thread.join()
never = groups[0].barrier()  # ranks 1 and 2 never enter it
waiting = (wait_unless_aborted, never, lambda: None)
threading.Thread(target=quietly, args=waiting, daemon=True).start()
if sys.argv[1] == "rendezvous":  # one whose peer never comes, given up: still in gloo at exit
    alone = (address, 7, 0, 2, 1, lambda: None)  # waited for at exit: not a proc
    threading.Thread(target=quietly, args=(open_group, *alone), daemon=True).start()
print("exiting", flush=True)
"""


@pytest.mark.parametrize("left", ["a collective", "rendezvous"])
def test_a_process_exits_cleanly_with_gloo_calls_in_flight(tmp_path: Path, left: str) -> None:
    """A replica's proc stopped while its threads wait in gloo (a collective never completed,
    a rendezvous given up) exits with code 0, not by std::terminate (SIGABRT, "terminate
    called without an active exception") as the interpreter finalizes around them."""
    script = tmp_path / "exits.py"
    script.write_text(EXITS_WITH_GLOO_CALLS_IN_FLIGHT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, str(script), left], env=env, capture_output=True, text=True, timeout=120
    )
    assert "terminate called" not in done.stderr, done.stderr
    assert (done.returncode, done.stdout) == (0, "exiting\n"), done.stderr


def test_a_proc_stopped_while_waiting_in_gloo_stops_cleanly(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A proc stopped while its endpoints wait in gloo (a collective, a rendezvous) exits
    without std::terminate, whose message its owner would print as the proc's stderr; its
    exit handlers still run."""
    server = StoreServer()
    address, store = server.addresses, StoreClient(server.addresses, 60.0)
    procs = this_host().spawn_procs(per_host={"ranks": 1}, name="strander")
    try:
        strander = procs.spawn("strander", xa.Strander)
        strander.wait_in_a_collective.call(address, "stop")
        strander.wait_in_a_rendezvous.call(address, "stop")
        store.wait(["stop-collective", "stop-rendezvous"])
    finally:
        procs.stop(grace_s=30.0).get(timeout=60)
    try:
        assert "terminate called" not in capfd.readouterr().err
        assert store.check(["stop-exit-handler"]), "the proc's own exit handler did not run"
    finally:
        store.close()
        server.close()
