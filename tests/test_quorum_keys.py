"""The store keys of a replica group's quorums (their rendezvous, their abort notices) are
deleted once no one can need them, so that a long run with many failures keeps a bounded
number of keys in its store (which holds 2^20 at most)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recovery.testing import (
    AbortNotices,
    QuorumKeys,
    StoreClient,
    StoreServer,
    abort_key,
    quorum_prefix,
)

#: Keys a rendezvous of a quorum writes (gloo's are the ranks' addresses and a few counters).
RENDEZVOUS_KEYS = 4


@pytest.fixture
def store() -> Iterator[tuple[StoreServer, StoreClient, AbortNotices]]:
    server = StoreServer(name="test-quorum-keys")
    client = StoreClient(server.addresses, 5.0)
    notices = AbortNotices(server.addresses, 5.0)
    yield server, client, notices
    notices.close()
    client.close()
    server.close()


def rendezvous(client: StoreClient, quorum: int) -> None:
    for index in range(RENDEZVOUS_KEYS):
        client.set(f"{quorum_prefix(quorum)}/rank{index}", b"address")


def quorums_with_keys(client: StoreClient, up_to: int) -> set[int]:
    return {
        q
        for q in range(1, up_to + 1)
        if client.check([f"{quorum_prefix(q)}/rank0"]) or client.check([abort_key(q)])
    }


def test_the_key_count_stays_bounded_over_many_quorums(
    store: tuple[StoreServer, StoreClient, AbortNotices],
) -> None:
    _, client, notices = store
    keys = QuorumKeys(notices)
    most = 0
    for quorum in range(1, 301):  # a group re-formed 300 times, a failure each time
        rendezvous(client, quorum)
        keys.formed(quorum, in_use=())
        notices.abort(quorum, "replica 1 died")
        most = max(most, client.num_keys())
    assert most <= 2 * (RENDEZVOUS_KEYS + 1), f"{most} keys held at once"
    assert quorums_with_keys(client, 300) == {300}


def test_the_keys_of_groups_still_in_use_stay_until_they_are_not(
    store: tuple[StoreServer, StoreClient, AbortNotices],
) -> None:
    _, client, notices = store
    keys = QuorumKeys(notices)
    for quorum in range(1, 6):
        rendezvous(client, quorum)
    keys.formed(4, in_use={2, 5})  # 2 and 5: standing groups, formed in advance
    assert quorums_with_keys(client, 6) == {2, 4, 5}
    notices.abort(3, "late")  # an abort notice given just after its quorum was forgotten
    rendezvous(client, 6)
    keys.formed(6, in_use={5})  # 2 no longer stands
    assert quorums_with_keys(client, 6) == {5, 6}


@settings(max_examples=40, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(1, 4), st.sets(st.integers(0, 3))), max_size=12))
def test_only_the_quorums_no_one_needs_lose_their_keys(
    formations: list[tuple[int, set[int]]],
) -> None:
    """Formations of quorums (each `gap` after the last, with the standing groups `in_use`
    given as offsets below it): after each, the keys of the quorum formed, of those in use
    and of newer ones are there; of every other older one, gone. A standing group holds its
    quorum from when it is numbered (after the last formation) until it is no longer in use."""
    server = StoreServer(name="test-quorum-keys-prop")
    client = StoreClient(server.addresses, 5.0)
    notices = AbortNotices(server.addresses, 5.0)
    try:
        keys, quorum, written, standing = QuorumKeys(notices), 0, 0, set[int]()
        for gap, offsets in formations:
            last, quorum = quorum, quorum + gap
            for fresh in range(written + 1, quorum + 3):  # up to two newer ones in advance
                rendezvous(client, fresh)
            written = max(written, quorum + 2)
            below = {quorum - offset for offset in offsets}
            in_use = standing = {q for q in below if q in standing or last < q < quorum}
            keys.formed(quorum, in_use)
            expected = in_use | {quorum} | set(range(quorum + 1, written + 1))
            assert quorums_with_keys(client, written) == expected
    finally:
        notices.close()
        client.close()
        server.close()
