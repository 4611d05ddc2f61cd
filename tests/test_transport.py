"""The transport layer on its own: serialization, framing, size limits, sockets."""

from __future__ import annotations

import marshal
import math
import os
import pickle
import shutil
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import transport
from transport import (
    MAGIC,
    OUT_OF_BAND_MIN_BYTES,
    Addresses,
    Inbox,
    MalformedMessage,
    MessageTooLarge,
    Outbox,
    Payload,
    SerializationError,
    TransportError,
    decode,
    dumps,
    encode,
    loads,
    message_type,
    new_context,
    private_runtime_dir,
)


@message_type
@dataclass(frozen=True, slots=True)
class Header:
    """A header type registered for these tests."""

    seq: int
    sender: str = "test"


def not_registered(seq: int, body: bytes = b"") -> list[bytes]:
    """A well-framed message whose header names a type no receiver knows, ``NotRegistered``
    (framed by hand, as transport's framing documents: magic, header length as a
    little-endian u32, codec ``m``, the marshal of the type name and fields, then the body)."""
    head = marshal.dumps((f"{__name__}.NotRegistered", seq))
    return [MAGIC + struct.pack("<I", len(head)) + b"m" + head + body]


def head_frames(payload: Payload | None = None) -> int:
    """How many frames encode() uses besides the out-of-band buffers (layout-independent)."""
    return len(encode(Header(0), payload)) - (len(payload.buffers) if payload else 0)


def buffer_frames(frames: list[Any], payload: Payload) -> list[bytes]:
    """The frames that carry `payload`'s out-of-band buffers, as bytes."""
    count = len(payload.buffers)
    return [bytes(memoryview(f)) for f in frames[len(frames) - count :]] if count else []


def roundtrip(value: Any) -> Any:
    """Payload.dump → encode → decode → load, the way a message travels."""
    frames = encode(Header(0), Payload.dump(value))
    envelope = decode(frames)
    assert envelope.header == Header(0)
    assert envelope.payload is not None
    return envelope.payload.load()


# -- structural comparison ----------------------------------------------------------------------


def assert_same(got: Any, want: Any, path: str = "value") -> None:
    """Structural equality that also checks container types, dtypes and shapes."""
    assert type(got) is type(want), f"{path}: type {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert got.requires_grad == want.requires_grad, f"{path}: requires_grad differs"
        assert torch.equal(got.detach(), want.detach()), f"{path}: tensor values differ"
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert np.array_equal(got, want), f"{path}: array values differ"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert got == want and math.copysign(1, got) == math.copysign(1, want), path
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


# -- out-of-band buffers ------------------------------------------------------------------------


def test_small_bytes_stay_in_band_large_bytes_become_a_frame() -> None:
    """DESIGN/transport: bytes of OUT_OF_BAND_MIN_BYTES or more travel as their own
    zero-copy frame."""
    small = b"s" * (OUT_OF_BAND_MIN_BYTES - 1)
    large = b"L" * OUT_OF_BAND_MIN_BYTES
    assert Payload.dump(small).buffers == []
    payload = Payload.dump({"small": small, "large": large})
    got = decode(encode(Header(1), payload)).payload.load()
    assert got == {"small": small, "large": large}
    assert type(got["large"]) is bytes
    assert len(payload.buffers) == 1, "large bytes were copied into the pickle stream"
    frames = encode(Header(1), payload)
    assert len(frames) == head_frames(payload) + 1
    assert buffer_frames(frames, payload) == [large]


def test_each_large_buffer_is_its_own_frame() -> None:
    value = [
        memoryview(b"a" * 4096),
        np.arange(1000, dtype=np.int64),
        torch.ones(1000),
        memoryview(b"b" * 5000),
    ]
    payload = Payload.dump(value)
    assert len(payload.buffers) == 4
    frames = encode(Header(2), payload)
    assert len(frames) == head_frames(payload) + 4
    assert buffer_frames(frames, payload)[0] == b"a" * 4096
    assert buffer_frames(frames, payload)[3] == b"b" * 5000
    assert sum(len(memoryview(f).cast("B")) for f in frames[: head_frames(payload)]) < 1000
    assert payload.nbytes == len(payload.body) + 4096 + 8000 + 4000 + 5000
    got = decode(frames).payload.load()
    assert got[0] == b"a" * 4096 and got[3] == b"b" * 5000
    assert_same(got[1:3], value[1:3])


def test_large_bytes_in_small_containers_travel_out_of_band() -> None:
    big = b"q" * OUT_OF_BAND_MIN_BYTES
    value = {"a": [big, (1, big)], "b": bytearray(big)}
    payload = Payload.dump(value)
    # `big` is one object referenced twice: like pickle itself, it travels once
    assert len(payload.buffers) == 2
    got = decode(encode(Header(9), payload)).payload.load()
    assert got == value and type(got["b"]) is bytearray and type(got["a"][1]) is tuple


def test_shared_references_and_cycles_survive_next_to_large_bytes() -> None:
    """Pickle keeps the shape of an object graph (shared sub-objects, cycles); sending large
    bytes out of band must not change it."""
    big = b"x" * (2 * OUT_OF_BAND_MIN_BYTES)
    shared = [big]
    got = roundtrip([shared, shared])
    assert got[0] == [big]
    assert got[0] is got[1], "a list referenced twice arrived as two different lists"
    cyclic: list[Any] = [big]
    cyclic.append(cyclic)
    got = roundtrip(cyclic)
    assert got[0] == big
    assert got[1] is got, "a self-referencing list lost its cycle"
    mapping: dict[str, Any] = {"data": big}
    mapping["self"] = mapping
    got = roundtrip(mapping)
    assert got["self"] is got, "a self-referencing dict lost its cycle"


def test_large_memoryview_and_bytearray_roundtrip() -> None:
    data = bytearray(range(256)) * 20
    got = roundtrip({"view": memoryview(data), "array": data})
    assert got["view"] == bytes(data)  # a memoryview arrives as bytes
    assert len(Payload.dump(memoryview(data)).buffers) == 1
    assert got["array"] == data and type(got["array"]) is bytearray


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, np.uint8, np.bool_])
def test_numpy_arrays_out_of_band(dtype: Any) -> None:
    array = (np.arange(4096) % 7).astype(dtype).reshape(64, 64)
    payload = Payload.dump(array)
    assert len(payload.buffers) == 1
    got = roundtrip(array)
    assert_same(got, array)
    assert got.flags.writeable
    got[0, 0] = 1  # writable and independent enough to mutate


def test_non_contiguous_numpy_array_roundtrips() -> None:
    array = np.arange(10000, dtype=np.float64).reshape(100, 100).T[::2]
    assert not array.flags.c_contiguous
    assert_same(roundtrip(array), array)


TENSORS = {
    "float32": lambda: torch.arange(1024, dtype=torch.float32),
    "int64 2d": lambda: torch.arange(1200, dtype=torch.int64).reshape(30, 40),
    "bfloat16": lambda: torch.linspace(-4, 4, 2048).to(torch.bfloat16),
    "float16": lambda: torch.linspace(-4, 4, 2048).to(torch.float16),
    "bool": lambda: torch.arange(4096) % 3 == 0,
    "transposed": lambda: torch.arange(2048, dtype=torch.float32).reshape(32, 64).t(),
    "strided slice": lambda: torch.arange(8192, dtype=torch.float64)[1::3],
    "offset view": lambda: torch.arange(4096, dtype=torch.float32)[100:],
    "expanded": lambda: torch.tensor([1.5]).expand(1024),
    "conj": lambda: torch.complex(torch.ones(512), torch.arange(512.0)).conj(),
    "3d permuted": lambda: (
        torch.arange(4096, dtype=torch.int32).reshape(8, 16, 32).permute(2, 0, 1)
    ),
}


@pytest.mark.parametrize("make", TENSORS.values(), ids=TENSORS.keys())
def test_torch_tensors_out_of_band_writable_and_equal(make: Any) -> None:
    tensor = make()
    payload = Payload.dump(tensor)
    assert len(payload.buffers) == 1, "a large CPU tensor should travel as one buffer frame"
    got = roundtrip(tensor)
    assert type(got) is torch.Tensor
    assert got.dtype == tensor.dtype and got.shape == tensor.shape
    assert torch.equal(got, tensor.resolve_conj())
    assert got.is_contiguous()
    before = got.clone()
    got.add_(1) if got.dtype != torch.bool else got.logical_not_()  # writable, no warning
    assert not torch.equal(got, before)


def test_tensor_received_over_zmq_is_writable_and_owned() -> None:
    context = new_context()
    inbox = Inbox(context, transport.tcp_address())
    outbox = Outbox(context)
    try:
        tensor = torch.arange(4096, dtype=torch.float32)
        outbox.send(inbox.address, encode(Header(3), Payload.dump(tensor)))
        got = receive(inbox).payload.load()
        assert torch.equal(got, tensor)
        got.mul_(2)
        assert torch.equal(got, tensor * 2)
        assert torch.equal(tensor, torch.arange(4096, dtype=torch.float32))
    finally:
        outbox.close(0)
        inbox.close()
        transport.close_context(context)


def test_small_tensor_uses_torch_pickling() -> None:
    tensor = torch.tensor([1.0, 2.0, 3.0])
    assert Payload.dump(tensor).buffers == []
    assert_same(roundtrip(tensor), tensor)


def test_parameter_roundtrip_keeps_type_and_requires_grad() -> None:
    param = torch.nn.Parameter(torch.randn(32, 32))
    frozen = torch.nn.Parameter(torch.randn(32, 32), requires_grad=False)
    assert len(Payload.dump(param).buffers) == 1
    want = param.detach().clone()
    got, got_frozen = roundtrip((param, frozen))
    assert type(got) is torch.nn.Parameter and got.requires_grad
    assert type(got_frozen) is torch.nn.Parameter and not got_frozen.requires_grad
    assert torch.equal(got.detach(), want)
    assert torch.equal(got_frozen.detach(), frozen.detach())
    with torch.no_grad():
        got.add_(1)  # writable
    assert torch.equal(got.detach(), want + 1)


def test_leaf_tensor_requiring_grad_roundtrips() -> None:
    leaf = torch.randn(1024, requires_grad=True)
    got = roundtrip(leaf)
    assert got.requires_grad and got.is_leaf
    assert torch.equal(got.detach(), leaf.detach())


def test_non_leaf_tensor_requiring_grad_arrives_as_a_leaf_with_equal_values() -> None:
    leaf = torch.randn(1024, requires_grad=True)
    result = leaf * 2
    got = roundtrip(result)
    assert got.is_leaf and got.requires_grad
    assert torch.equal(got.detach(), result.detach())


def test_a_function_pickled_by_value_keeps_its_file_name_for_tracebacks() -> None:
    namespace: dict[str, Any] = {"__name__": "not_importable_module"}
    exec(compile("def where():\n    return 1\n", "/some/script.py", "exec"), namespace)
    got = roundtrip(namespace["where"])
    assert got() == 1
    assert got.__code__.co_filename == "/some/script.py"  # cloudpickle 3.1.3 writes <dynamic-code>


def test_state_dict_roundtrip() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    state = model.state_dict()
    got = roundtrip(state)
    assert list(got) == list(state)
    for key in state:
        assert torch.equal(got[key], state[key])


# -- size limit ---------------------------------------------------------------------------------


def test_message_too_large_at_encode_has_a_clear_message() -> None:
    payload = Payload.dump(b"x" * 5000)
    with pytest.raises(MessageTooLarge) as info:
        encode(Header(4), payload, max_bytes=1000)
    text = str(info.value)
    assert "Header" in text
    assert str(payload.nbytes) in text
    assert "1000" in text
    assert "MESHVISOR_MAX_MESSAGE_BYTES" in text
    assert isinstance(info.value, ValueError) and isinstance(info.value, TransportError)
    encode(Header(4), payload, max_bytes=payload.nbytes)  # exactly at the limit is fine


def test_message_too_large_at_decode() -> None:
    frames = encode(Header(5), Payload.dump(b"y" * 5000))
    with pytest.raises(MessageTooLarge, match="over the limit of 1000"):
        decode(frames, max_bytes=1000)


# -- malformed frames ---------------------------------------------------------------------------


def _garbage_header() -> list[bytes]:
    """A well-framed message whose pickled header bytes were replaced by garbage."""
    first = bytes(memoryview(encode(Header(1))[0]))
    size = len(pickle.dumps(Header(1), protocol=5))
    return [first[:-size] + b"\xfe" * size]


def _bumped_version() -> list[bytes]:
    first = bytes(memoryview(encode(Header(1))[0]))
    return [MAGIC[:-1] + bytes([MAGIC[-1] + 1]) + first[len(MAGIC) :]]


MALFORMED = {
    "empty": [],
    "no magic": [b"hello world"],
    "empty frame": [b""],
    "magic only": [MAGIC],
    "other version": _bumped_version(),
    "garbage header": _garbage_header(),
    "truncated": [bytes(memoryview(encode(Header(1))[0]))[:-3]],
    "unknown header type": not_registered(1),
    "unknown header with payload": not_registered(2, Payload.dump("x").body),
}


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_frames_raise_malformed_message(frames: list[bytes]) -> None:
    with pytest.raises(MalformedMessage):
        decode(frames)


def test_unknown_header_type_is_named() -> None:
    with pytest.raises(MalformedMessage, match="NotRegistered"):
        decode(not_registered(1))


def test_a_header_with_missing_or_extra_fields_is_rejected_by_name() -> None:
    """Received headers are built field by field: every declared field must be there, no more."""
    for fields in ((1,), (1, "test", "extra")):
        head = marshal.dumps((f"{__name__}.Header", *fields))
        frame = MAGIC + struct.pack("<I", len(head)) + b"m" + head
        with pytest.raises(MalformedMessage, match=f"Header header holds {len(fields)} fields"):
            decode([frame])
    assert decode(encode(Header(3, "x"))).header == Header(3, "x")


def test_payload_is_decoded_lazily() -> None:
    """A body that cannot be unpickled does not fail decode(), only load()."""
    envelope = decode([*encode(Header(6)), b"not a pickle"])
    assert envelope.header == Header(6)
    assert envelope.payload is not None
    with pytest.raises(Exception):  # noqa: B017 - pickle raises several types
        envelope.payload.load()
    assert decode(encode(Header(7))).payload is None


# -- serialization errors -----------------------------------------------------------------------


def test_unpicklable_value_raises_serialization_error_naming_the_type() -> None:
    with pytest.raises(SerializationError) as info:
        dumps(threading.Lock())
    assert isinstance(info.value, TypeError)
    assert "lock" in str(info.value)
    assert "cloudpickle" in str(info.value)


def test_nested_unpicklable_value_names_the_inner_type() -> None:
    with pytest.raises(SerializationError) as info:
        Payload.dump({"ok": 1, "bad": [threading.Lock()]})
    assert "_thread.lock" in str(info.value)
    assert str(info.value).startswith("cannot serialize dict value")


def test_generator_is_unpicklable() -> None:
    with pytest.raises(SerializationError, match="generator"):
        dumps(x for x in range(3))


def test_lambdas_and_local_classes_are_picklable() -> None:
    class Local:
        def __init__(self, x: int) -> None:
            self.x = x

    body, buffers = dumps((lambda y: y + 1, Local(4)))
    fn, obj = loads(body, buffers)
    assert fn(1) == 2 and obj.x == 4


# -- hypothesis round trip ----------------------------------------------------------------------

NUMPY_DTYPES = [np.int8, np.int32, np.int64, np.uint8, np.float32, np.float64, np.bool_]
TORCH_DTYPES = [
    torch.float32,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bfloat16,
    torch.float16,
    torch.uint8,
    torch.bool,
]


@st.composite
def numpy_arrays(draw: Any) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40))
    if dtype.kind == "f":
        elements = st.floats(-1e6, 1e6, allow_nan=False, width=dtype.itemsize * 8)
    else:
        elements = None
    return draw(hnp.arrays(dtype, shape, elements=elements))


@st.composite
def torch_tensors(draw: Any) -> torch.Tensor:
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(st.lists(st.integers(0, 40), min_size=0, max_size=3))
    count = math.prod(shape)
    seed = draw(st.integers(0, 2**31))
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        tensor = torch.randint(0, 2, (count,), generator=generator).bool()
    elif dtype.is_floating_point:
        tensor = (torch.randn(count, generator=generator) * 100).to(dtype)
    else:
        tensor = torch.randint(0, 100, (count,), generator=generator).to(dtype)
    tensor = tensor.reshape(shape)
    if draw(st.booleans()) and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)  # non-contiguous
    return tensor


leaves = (
    st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=64)
    | st.binary(min_size=OUT_OF_BAND_MIN_BYTES, max_size=3 * OUT_OF_BAND_MIN_BYTES)
    | st.none()
    | st.booleans()
    | numpy_arrays()
    | torch_tensors()
)
nested = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nested)
def test_hypothesis_roundtrip_through_frames(value: Any) -> None:
    got = roundtrip(value)
    assert_same(got, value)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=3 * OUT_OF_BAND_MIN_BYTES), max_size=6))
def test_hypothesis_one_frame_per_large_buffer(chunks: list[bytes]) -> None:
    views = [memoryview(c) for c in chunks]
    payload = Payload.dump(views)
    large = [c for c in chunks if len(c) >= OUT_OF_BAND_MIN_BYTES]
    assert [bytes(memoryview(b)) for b in payload.buffers] == large
    frames = encode(Header(8), payload)
    assert len(frames) == head_frames(payload) + len(large)
    assert buffer_frames(frames, payload) == large
    assert decode(frames).payload.load() == chunks


# -- sockets ------------------------------------------------------------------------------------


def receive(inbox: Inbox, timeout: float = 10.0) -> Any:
    """The next valid message on `inbox`, waiting at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        envelope = inbox.receive_nowait()
        if envelope is not None:
            return envelope
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no valid message arrived")
        inbox.poll(max(1, int(remaining * 1000)))


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    path = private_runtime_dir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[Any]]:
    context = new_context()
    yield context
    transport.close_context(context)  # also stops the CURVE authenticator of tcp inboxes


def test_private_runtime_dir_is_private(ipc_dir: str) -> None:
    mode = stat.S_IMODE(os.stat(ipc_dir).st_mode)
    assert mode == 0o700
    assert os.path.basename(ipc_dir).startswith("meshvisor-")
    assert os.path.dirname(ipc_dir) == os.environ["XDG_RUNTIME_DIR"]


def test_inbox_drops_garbage_and_receives_the_next_valid_message(
    ipc_dir: str,
    zmq_context: zmq.Context[Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    inbox = Inbox(zmq_context, f"ipc://{ipc_dir}/inbox")
    raw = zmq_context.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(inbox.address)
        for frames in MALFORMED.values():
            if frames:  # zmq cannot send an empty multipart message
                raw.send_multipart(frames)
        raw.send_multipart(encode(Header(42), Payload.dump("valid")))
        envelope = receive(inbox)
        assert envelope.header == Header(42)
        assert envelope.payload.load() == "valid"
        assert inbox.receive_nowait() is None
    finally:
        raw.close(0)
        inbox.close()
    assert not os.path.exists(f"{ipc_dir}/inbox"), "closing an ipc inbox removes its socket file"
    err = capsys.readouterr().err
    assert err.count("message_dropped") == len([f for f in MALFORMED.values() if f])
    assert f"unknown type ('{__name__}.NotRegistered',)" in err  # it names the type


def test_a_waiting_receive_ends_with_a_message_or_its_timeout(
    ipc_dir: str, zmq_context: zmq.Context[Any]
) -> None:
    """`receive_nowait(wait_ms)` blocks in one receive: None when nothing came in time, else
    the message (from a batch, the first; the rest wait for `receive_received`)."""
    inbox = Inbox(zmq_context, f"ipc://{ipc_dir}/inbox")
    outbox = Outbox(zmq_context)
    try:
        assert inbox.receive_nowait(1) is None
        for n in range(3):
            assert outbox.send_soon(inbox.address, encode(Header(n), Payload.dump(n))) == (n == 0)
        threading.Timer(0.2, outbox.flush).start()  # arrives while the receive waits
        first = inbox.receive_nowait(30_000)
        rest = [inbox.receive_received(), inbox.receive_received()]
        assert [e.header for e in (first, *rest) if e is not None] == [Header(n) for n in range(3)]
        assert inbox.receive_received() is None and inbox.receive_nowait(1) is None
        outbox.send(inbox.address, encode(Header(3), Payload.dump(3)))
        late = inbox.receive_nowait(10**12)  # longer than a socket's timeout holds: no error
        assert late is not None and late.header == Header(3)
        outbox.send(inbox.address, encode(Header(4), Payload.dump(4)))
        assert inbox.poll(10**12)  # nor a poll's
        polled = inbox.receive_nowait()
        assert polled is not None and polled.header == Header(4)
    finally:
        outbox.close(linger_ms=0)
        inbox.close()


def test_inbox_drops_oversized_message_and_receives_the_next(
    ipc_dir: str, zmq_context: zmq.Context[Any]
) -> None:
    """DESIGN: oversized frames are rejected and logged, never crash the receiver."""
    inbox = Inbox(zmq_context, f"ipc://{ipc_dir}/inbox", max_bytes=10_000)
    raw = zmq_context.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(inbox.address)
        raw.send_multipart(encode(Header(1), Payload.dump(b"z" * 50_000)))
        raw.send_multipart([b"g" * 50_000])
        raw.send_multipart(encode(Header(2), Payload.dump("small")))
        envelope = receive(inbox)
        assert envelope.header == Header(2)
    finally:
        raw.close(0)
        inbox.close()


def test_inbox_on_a_used_address_raises_transport_error(
    ipc_dir: str, zmq_context: zmq.Context[Any]
) -> None:
    first = Inbox(zmq_context, transport.tcp_address())
    try:
        with pytest.raises(TransportError, match="cannot listen"):
            Inbox(zmq_context, first.address)
    finally:
        first.close()


def test_fifo_per_sender_1000_messages(ipc_dir: str, zmq_context: zmq.Context[Any]) -> None:
    inbox = Inbox(zmq_context, f"ipc://{ipc_dir}/fifo")
    outboxes = [Outbox(zmq_context) for _ in range(3)]
    count = 1000
    try:

        def send_all(sender: int) -> None:
            for seq in range(count):
                repeat = 600 if seq % 5 == 0 else 1  # some messages carry a buffer frame
                payload = Payload.dump(b"%d" % seq * repeat)
                outboxes[sender].send(inbox.address, encode(Header(seq, f"s{sender}"), payload))

        threads = [threading.Thread(target=send_all, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        received: dict[str, list[int]] = {f"s{i}": [] for i in range(3)}
        for _ in range(3 * count):
            envelope = receive(inbox)
            received[envelope.header.sender].append(envelope.header.seq)
            if envelope.header.seq % 5 == 0:
                assert envelope.payload.load() == b"%d" % envelope.header.seq * 600
        assert inbox.receive_nowait() is None
        for sender, seqs in received.items():
            assert seqs == list(range(count)), f"{sender} out of order"
    finally:
        for outbox in outboxes:
            outbox.close(0)
        inbox.close()


def test_outbox_queues_until_the_receiver_binds(
    ipc_dir: str, zmq_context: zmq.Context[Any]
) -> None:
    """An Outbox never blocks on an absent receiver; messages arrive once it binds."""
    address = f"ipc://{ipc_dir}/late"
    outbox = Outbox(zmq_context)
    try:
        for seq in range(10):
            outbox.send(address, encode(Header(seq)))
        inbox = Inbox(zmq_context, address)
        try:
            assert [receive(inbox).header.seq for _ in range(10)] == list(range(10))
        finally:
            inbox.close()
    finally:
        outbox.close(0)


def test_closed_outbox_refuses_to_send(zmq_context: zmq.Context[Any]) -> None:
    outbox = Outbox(zmq_context)
    outbox.close(0)
    with pytest.raises(TransportError, match="closed"):
        outbox.send("tcp://127.0.0.1:1", encode(Header(1)))


def test_zero_copy_send_snapshots_the_value_at_send_time(zmq_context: zmq.Context[Any]) -> None:
    """A tensor mutated right after send() must arrive with the values it had when sent."""
    inbox = Inbox(zmq_context, transport.tcp_address())
    outbox = Outbox(zmq_context)
    try:
        tensor = torch.zeros(4 << 20, dtype=torch.float32)  # 16 MiB: zmq will not copy it
        outbox.send(inbox.address, encode(Header(1), Payload.dump(tensor)))
        tensor.fill_(1.0)  # the caller owns its tensor again once send() returned
        got = receive(inbox).payload.load()
        assert int(got.count_nonzero()) == 0, "the receiver saw a mutation made after send()"
    finally:
        outbox.close(0)
        inbox.close()


# -- a real agent survives bad input ------------------------------------------------------------

AGENT_SCRIPT = textwrap.dedent("""
    import sys, zmq
    import mesh.testing
    from mesh import this_host
    from mesh.testing import wire
    from transport import encode

    sys.path.insert(0, {tests!r})
    import actors

    procs = this_host().spawn_procs(per_host={{"gpus": 1}})
    print("ECHO", procs.spawn("echo", actors.Echo).echo.call_one(7).get(timeout=30), flush=True)
    agent = mesh.testing.local_agent()
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 5000)
    raw.connect(agent.address)
    raw.send_multipart([b"garbage"])
    raw.send_multipart([b"MVnot a valid header"])
    raw.send_multipart([b"x" * 100_000])  # over MESHVISOR_MAX_MESSAGE_BYTES
    # Same connection, so the agent sees this only after the bad frames (FIFO per sender).
    raw.send_multipart(encode(wire.ShutdownAgent(5.0)))
    print("AGENT EXIT", agent.process.wait(30), flush=True)
    raw.close()
    mesh.testing.shutdown()
""")


def test_agent_survives_garbage_and_oversized_frames(tmp_path: Any) -> None:
    """DESIGN: malformed or oversized frames are rejected and logged, never crash an agent.
    The agent must still serve the request that follows them (a clean shutdown, exit 0)."""
    script = tmp_path / "client.py"
    script.write_text(AGENT_SCRIPT.format(tests=os.path.dirname(__file__)))
    env = dict(os.environ, MESHVISOR_MAX_MESSAGE_BYTES="65536")
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90
    )
    assert "ECHO 7" in result.stdout, result.stderr
    assert "AGENT EXIT 0" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("message_dropped") >= 2, result.stderr


# -- which address a peer is handed ---------------------------------------------------------------

ipc_addresses = st.from_regex(r"ipc:///tmp/meshvisor-[a-z0-9]{1,8}/[a-z0-9-]{1,12}", fullmatch=True)
tcp_addresses = st.builds("tcp://127.0.0.1:{}".format, st.integers(1, 65535))


@given(
    st.one_of(ipc_addresses, st.none()),
    st.one_of(tcp_addresses, st.none()),
    st.one_of(ipc_addresses, tcp_addresses, st.none()),
)
def test_a_peer_is_handed_ipc_when_it_is_on_this_host_else_the_widest(
    ipc: str | None, tcp: str | None, peer: str | None
) -> None:
    """An ipc peer (this host) gets the ipc address whenever there is one, so that a peer
    without keys never needs them; any other peer gets tcp when there is one; a set of one
    address hands out that one."""
    if ipc is None and tcp is None:
        return
    addresses = Addresses(ipc, tcp)
    handed = addresses.nearest_for(peer)
    assert handed in list(addresses)
    assert addresses.widest == (tcp or ipc)
    if ipc is not None and (tcp is None or (peer or "").startswith("ipc://")):
        assert handed == ipc
    else:
        assert handed == tcp


def test_a_batched_send_to_what_cannot_be_reached_fails_at_once() -> None:
    """`send_soon` refuses an address it cannot connect to when called, as `send` does, not
    later in a flush: the sender learns that its message (a reply) is lost."""
    context = new_context()
    outbox = Outbox(context)
    try:
        with pytest.raises(TransportError, match="not a meshvisor address"):
            outbox.send_soon("nowhere", encode(Header(1)))
    finally:
        outbox.close(0)
        context.term()


def test_a_holder_of_the_whole_set_takes_ipc_only_where_its_socket_file_is() -> None:
    """A port's holder (`reachable_here`) uses the ipc address when that socket exists on its
    host, else tcp: a holder on another host never sends to a path it cannot reach."""
    folder = private_runtime_dir()
    context = new_context()
    inbox = Inbox(context, f"ipc://{folder}/here")
    try:
        tcp = "tcp://127.0.0.1:1"
        assert Addresses(inbox.address, tcp).reachable_here() == inbox.address
        assert Addresses(f"ipc://{folder}/elsewhere", tcp).reachable_here() == tcp
        assert Addresses(None, tcp).reachable_here() == tcp
    finally:
        inbox.close()
        context.term()
        shutil.rmtree(folder, ignore_errors=True)


def test_the_host_to_listen_at_for_a_peer_is_the_interface_routed_to_it() -> None:
    """A peer on loopback is answered on loopback (nothing is sent to find that out)."""
    assert transport.host_towards("tcp://127.0.0.1:5555") == "127.0.0.1"
    assert transport.host_towards("tcp://127.3.4.5:1") == "127.0.0.1"
