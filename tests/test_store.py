"""The replica group's key-value store: c10d's semantics over meshvisor's transport.

Its server (`StoreServer`) runs on a thread of the controller; `StoreClient` is a
`torch.distributed.Store` that gloo forms process groups through. Real sockets and processes.
"""

from __future__ import annotations

import datetime
import os
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from store_processes import python, store_process

import transport
from mesh.tooling import sweep_stale_run_dirs
from recovery.testing import StoreClient, StoreServer


@pytest.fixture(scope="module")
def server() -> Iterator[StoreServer]:
    store = StoreServer(name="test-store")
    yield store
    store.close()


@pytest.fixture
def client(server: StoreServer) -> Iterator[StoreClient]:
    store = StoreClient(server.addresses, 5.0)
    yield store
    store.close()


def test_the_operations_gloo_and_abort_notices_use(client: StoreClient) -> None:
    client.set("ops/a", b"1")
    client.set("ops/text", "words")
    assert client.get("ops/a") == b"1" and client.get("ops/text") == b"words"
    assert client.check(["ops/a", "ops/text"]) and not client.check(["ops/a", "ops/none"])
    assert client.add("ops/n", 3) == 3 and client.add("ops/n", -5) == -2
    assert client.get("ops/n") == b"-2"  # kept as a decimal number, as c10d does
    assert client.compare_set("ops/c", "", "v") == b"v"  # missing and expected empty: set
    assert client.compare_set("ops/c", "x", "w") == b"v"  # not the expected value: kept
    assert client.compare_set("ops/c", "v", "w") == b"w"
    assert client.compare_set("ops/missing", "x", "w") == b"x"
    assert client.delete_key("ops/c") and not client.delete_key("ops/c")
    client.multi_set(["ops/m1", "ops/m2"], ["1", "2"])  # torch builds these on the above
    assert client.multi_get(["ops/m1", "ops/m2"]) == [b"1", b"2"]
    client.append("ops/m1", "9")
    assert client.get("ops/m1") == b"19"
    client.wait(["ops/a", "ops/m2"])
    assert client.num_keys() >= 5
    clone = client.clone()
    assert clone.get("ops/a") == b"1"
    clone.close()


def test_get_and_wait_block_until_the_key_is_set_or_the_timeout_passes(
    server: StoreServer, client: StoreClient
) -> None:
    def later() -> None:
        time.sleep(0.2)
        other = StoreClient(server.addresses, 5.0)
        other.set("block/late", b"here")
        other.close()

    setter = threading.Thread(target=later)
    setter.start()
    assert client.get("block/late") == b"here"
    setter.join()
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout"):  # type: ignore[attr-defined]
        client.wait(["block/never"], datetime.timedelta(seconds=0.3))
    assert time.monotonic() - started < 3.0
    client.set_timeout(datetime.timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError, match="block/never"):  # type: ignore[attr-defined]
        client.get("block/never")


def test_add_from_many_threads_of_one_process_is_atomic(client: StoreClient) -> None:
    def add() -> None:
        for _ in range(50):
            client.add("threads/n", 1)

    threads = [threading.Thread(target=add) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert client.get("threads/n") == b"400"


_KEYS = st.sampled_from(["a", "b", "c"])
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), _KEYS, st.binary(max_size=8)),
        st.tuples(st.just("add"), _KEYS, st.integers(-1000, 1000)),
        st.tuples(st.just("delete"), _KEYS),
        st.tuples(st.just("check"), _KEYS),
        st.tuples(st.just("get"), _KEYS),
    ),
    max_size=30,
)
_runs = iter(range(1 << 30))


@settings(max_examples=60, deadline=None)
@given(ops=_OPS)
def test_any_sequence_of_operations_acts_as_a_dict(server: StoreServer, ops: list[tuple]) -> None:
    prefix = f"model{next(_runs)}/"
    store = StoreClient(server.addresses, 5.0)
    model: dict[str, bytes] = {}
    try:
        for op, key, *arg in ops:
            key = prefix + key
            if op == "set":
                store.set(key, arg[0])
                model[key] = arg[0]
            elif op == "add":
                if key in model and not model[key].strip().lstrip(b"-").isdigit():
                    with pytest.raises(ValueError, match="not a number"):
                        store.add(key, arg[0])
                    continue
                model[key] = str(int(model.get(key, b"0")) + arg[0]).encode()
                assert store.add(key, arg[0]) == int(model[key])
            elif op == "delete":
                assert store.delete_key(key) == (model.pop(key, None) is not None)
            elif op == "check":
                assert store.check([key]) == (key in model)
            elif key in model:
                assert store.get(key) == model[key]
    finally:
        store.close()


_WRITES = st.lists(
    st.tuples(
        st.sampled_from(["set", "add", "delete"]),
        st.sampled_from(["a", "b"]),
        st.integers(-5, 5),
        st.sampled_from(["once", "twice", "resent only"]),
    ),
    max_size=20,
)
_HEADER = struct.Struct("!4sBQI")  # magic, operation, request id, timeout (ms)
_RESENT = 0x80  # the operation's high bit: a request sent again after a reconnect
_FORGOTTEN = 3  # the status of a write sent again that the store cannot tell it applied


def _write(op: str, request_id: int, key: bytes, amount: int, resent: bool = False) -> list[bytes]:
    """A SET (to the amount, written out), ADD (of the amount) or DELETE request."""
    flag = _RESENT if resent else 0
    if op == "set":
        return [_HEADER.pack(b"MVS1", 1 | flag, request_id, 0), key, str(amount).encode()]
    if op == "add":
        return [_HEADER.pack(b"MVS1", 4 | flag, request_id, 0), key, struct.pack("!q", amount)]
    return [_HEADER.pack(b"MVS1", 6 | flag, request_id, 0), key]


def _applied(model: dict[bytes, bytes], op: str, key: bytes, amount: int) -> list[bytes]:
    """What the write does to `model`, and the answer's frames after the header."""
    if op == "set":
        model[key] = str(amount).encode()
        return []
    if op == "add":
        model[key] = str(int(model.get(key, b"0")) + amount).encode()
        return [model[key]]
    return [b"1" if model.pop(key, None) is not None else b"0"]


@settings(max_examples=40, deadline=None)
@given(writes=_WRITES)
def test_a_write_sent_again_with_its_id_is_answered_not_applied_again(
    server: StoreServer, writes: list[tuple[str, str, int, str]]
) -> None:
    """A requester that sends a write again with the same request id, as a client does after
    a reconnect when it cannot know whether the first one arrived, gets the first answer
    again, and the store changes once: the same answers and values as sending each once. A
    write whose first copy was lost is applied when it comes again, if the store holds an
    earlier write of that requester (so it knows this one is new); else it cannot tell, and
    refuses it."""
    prefix = f"again{next(_runs)}/"
    requester = transport.Requester(
        zmq.Context.instance(), str(server.addresses.ipc), max_bytes=1 << 21
    )
    store = StoreClient(server.addresses, 5.0)
    model: dict[bytes, bytes] = {}
    wrote = False
    try:
        for request_id, (op, name, amount, sent) in enumerate(writes, 1):
            key = (prefix + name).encode()
            copies = {"once": [False], "twice": [False, True], "resent only": [True]}[sent]
            if copies == [True] and not wrote:
                assert requester.send(_write(op, request_id, key, amount, resent=True), 5000)
                reply = requester.receive(5000)
                assert reply is not None and reply[0] == struct.pack("!QB", request_id, _FORGOTTEN)
                continue
            expected = [struct.pack("!QB", request_id, 0), *_applied(model, op, key, amount)]
            for resent in copies:
                assert requester.send(_write(op, request_id, key, amount, resent), 5000)
                assert requester.receive(5000) == expected
            wrote = True
        for name in ("a", "b"):
            key = (prefix + name).encode()
            assert store.check([key.decode()]) == (key in model)
            if key in model:
                assert store.get(key.decode()) == model[key]
    finally:
        requester.close()
        store.close()


def test_a_write_sent_again_after_the_store_forgot_it_is_refused_not_applied_twice(
    server: StoreServer,
) -> None:
    """The store keeps the last write of each requester within bounds (32 MiB of answers):
    once 33 clients' answers of 1 MiB pushed a requester's ADD out, the same ADD sent again
    (as after a reconnect) cannot be told from a new one: it is refused, not added twice."""
    key = f"forgot{next(_runs)}/count"
    requester = transport.Requester(
        zmq.Context.instance(), str(server.addresses.ipc), max_bytes=1 << 21
    )
    clients = [StoreClient(server.addresses, 30.0) for _ in range(33)]
    try:
        add = _write("add", 1, key.encode(), 5)
        assert requester.send(add, 5000) and requester.receive(5000) == [
            struct.pack("!QB", 1, 0),
            b"5",
        ]
        big = b"x" * (1 << 20)
        for index, client in enumerate(clients):  # each answer holds the 1 MiB value
            assert client.compare_set(f"forgot-big/{index}", b"", big) == big
        assert requester.send(_write("add", 1, key.encode(), 5, resent=True), 5000)
        reply = requester.receive(5000)
        assert reply is not None and reply[0] == struct.pack("!QB", 1, _FORGOTTEN), reply
        assert b"no longer remembers whether it applied" in reply[1], reply
        assert clients[0].get(key) == b"5"  # added once
    finally:
        clients[0].delete_prefixes(["forgot-big/"])
        for client in clients:
            client.close()
        requester.close()


GLOO_RANK = """
import datetime, sys, torch, torch.distributed as dist
from transport import Addresses
from recovery.testing import StoreClient
rank, world = int(sys.argv[2]), int(sys.argv[3])
store = StoreClient(Addresses(sys.argv[1]), 30.0)
group = dist.ProcessGroupGloo(
    dist.PrefixStore("gloo-test", store), rank, world, datetime.timedelta(seconds=30)
)
tensor = torch.ones(4) * (rank + 1)
group.allreduce([tensor]).wait()
print(tensor.tolist(), flush=True)
"""


def test_a_gloo_group_of_three_processes_forms_through_it_and_reduces(
    server: StoreServer,
) -> None:
    """This process is rank 0; two others, ranks 1 and 2."""
    ranks = [
        python(
            GLOO_RANK,
            str(server.addresses.ipc),
            str(rank),
            "3",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in (1, 2)
    ]
    try:
        store = StoreClient(server.addresses, 60.0)
        group = dist.ProcessGroupGloo(  # type: ignore[attr-defined]
            dist.PrefixStore("gloo-test", store),
            0,
            3,
            datetime.timedelta(seconds=60),  # type: ignore[attr-defined]
        )
        tensor = torch.ones(4)
        group.allreduce([tensor]).wait()
        store.close()
        assert tensor.tolist() == [6.0] * 4
        outputs = [rank.communicate(timeout=90) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    for (out, err), rank in zip(outputs, ranks, strict=True):
        assert rank.returncode == 0, err
        assert out.strip() == "[6.0, 6.0, 6.0, 6.0]"


def _raw_request(address: str, frames: list[bytes]) -> list[bytes] | None:
    requester = transport.Requester(zmq.Context.instance(), address, max_bytes=1 << 21)
    try:
        assert requester.send(frames, 5000)
        return requester.receive(5000)
    finally:
        requester.close()


def test_bad_requests_get_an_error_and_the_server_goes_on(
    server: StoreServer, client: StoreClient
) -> None:
    address = str(server.addresses.ipc)
    header = struct.Struct("!4sBQI")
    refused = {
        "garbage": [b"garbage"],
        "unknown op": [header.pack(b"MVS1", 99, 5, 0)],
        "no key": [header.pack(b"MVS1", 1, 6, 0)],
        "long key": [header.pack(b"MVS1", 2, 7, 0), b"k" * 5000],
        "short amount": [header.pack(b"MVS1", 4, 8, 0), b"k", b"1"],
    }
    for what, frames in refused.items():
        reply = _raw_request(address, frames)
        assert reply is not None and reply[0][-1:] == b"\x01", what  # status: error
    with pytest.raises(ValueError, match="larger than the store allows"):
        client.set("bad/big", b"x" * ((1 << 20) + 1))
    client.set("bad/text", b"abc")
    with pytest.raises(ValueError, match="not a number"):
        client.add("bad/text", 1)
    assert client.get("bad/text") == b"abc"  # still serving


def test_an_add_whose_sum_is_too_long_to_write_is_refused_and_the_server_goes_on(
    client: StoreClient,
) -> None:
    longest = "9" * 4300  # the most digits Python converts by default
    client.set("bad/long-number", longest)
    with pytest.raises(ValueError, match="bad/long-number"):
        client.add("bad/long-number", 1)  # 4301 digits
    assert client.get("bad/long-number") == longest.encode()  # still serving, unchanged


def test_waits_of_months_are_served_and_the_server_goes_on(
    server: StoreServer, client: StoreClient
) -> None:
    """A timeout longer than zmq waits at once (a C int of milliseconds, about 24 days)."""
    header = struct.Struct("!4sBQI")
    months = datetime.timedelta(days=60)
    client.set("months/there", b"1")
    client.wait(["months/there"], months)  # (no error from the client's own wait)
    requester = transport.Requester(
        zmq.Context.instance(), str(server.addresses.ipc), max_bytes=1 << 21
    )
    try:
        assert requester.send([header.pack(b"MVS1", 2, 1, (1 << 32) - 1), b"months/key"], 5000)
        assert requester.send([header.pack(b"MVS1", 5, 2, 0), b"months/there"], 5000)
        checked = requester.receive(5000)  # answered after the GET began to wait: the server
        assert checked is not None and checked[0][:8] == struct.pack("!Q", 2)  # planned its
        client.set("months/key", b"v")  # next wake-up before it reads this set
        got = requester.receive(5000)
        assert got is not None and got[0] == struct.pack("!QB", 1, 0) and got[1:] == [b"v"]
    finally:
        requester.close()


def test_a_tcp_peer_without_the_allocations_keys_is_never_answered(
    server: StoreServer, client: StoreClient, tmp_path: Path
) -> None:
    assert server.addresses.tcp is not None, "the suite has keys: the store listens on tcp"
    others = transport.CurveKeys.create(tmp_path / "other-keys")
    context = zmq.Context()
    stranger = context.socket(zmq.DEALER)
    try:
        stranger.curve_secretkey, stranger.curve_publickey = others.secret, others.public
        stranger.curve_serverkey = others.public
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(server.addresses.tcp)
        stranger.send_multipart([struct.pack("!4sBQI", b"MVS1", 1, 1, 0), b"forged", b"x"])
        assert not stranger.poll(1000), "an unauthenticated peer got an answer"
    finally:
        stranger.close(linger=0)
        context.term()
    assert not client.check(["forged"])
    assert _raw_request(server.addresses.tcp, [b"garbage"]) is not None  # with the keys: yes


def test_closing_the_server_ends_waits_and_removes_its_socket_file() -> None:
    server = StoreServer()
    store = StoreClient(server.addresses, 30.0)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            store.get("close/never")
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    server.close()
    waiter.join(10.0)
    store.close()
    assert not waiter.is_alive() and errors, "a wait outlived its store"
    assert "the store closed" in str(errors[0]) or isinstance(errors[0], dist.DistError)  # type: ignore[attr-defined]
    assert server.addresses.ipc is not None
    assert not os.path.exists(server.addresses.ipc[len("ipc://") :])


def test_the_death_of_the_servers_process_ends_a_blocked_wait() -> None:
    with store_process() as (process, addresses):
        assert addresses.ipc is not None
        store = StoreClient(transport.Addresses(addresses.ipc), 60.0)
        store.set("death/here", b"1")
        threading.Timer(0.5, os.kill, (process.pid, signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(dist.DistNetworkError, match="went away"):  # type: ignore[attr-defined]
            store.get("death/never")
        assert time.monotonic() - started < 30.0, "the wait lasted until its timeout"
        store.close()
        process.wait(30.0)
        directory = os.path.dirname(addresses.ipc[len("ipc://") :])
        assert os.path.isdir(directory), "a SIGKILLed process cannot remove its store's directory"
        sweep_stale_run_dirs(os.path.dirname(directory))  # what the next client does as it starts
        assert not os.path.exists(directory), "the dead process's store directory was not swept"
