"""Python and C function calls per proc of a call with a large payload to all N procs of one
host, counted with `sys.setprofile`: a measure the load on the machine does not move.

* proc: reading one `ArenaCall` (decode its frame, find the payload in the arena, build the
  `CallActor`, unpickle a 1 MB `bytes` argument), beside a plain `CallActor` with an empty
  argument (the floor: what any call costs to decode and unpickle);
* proc: reading one `SharedCall` (a 1 MB tensor in a memory file of its own: decode, check
  and map the file, unpickle the tensor on the mapping), when torch is installed;
* agent: its `FanOutRelay` delivering one fanned-out call to N procs (PULL sockets of this
  script stand in for them), per proc, with a 1 MB payload (shared through the arena), a
  1 MB tensor (a `SharedCall`) and a small one (copied into each proc's message).

    python3 benchmarks/bench_arena_calls.py [--procs 32]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from mesh.testing import FanOutRelay, PayloadArena, ProcRecord, ProcTable, wire
from mesh.testing import arena_wire as aw
from mesh.testing import fanout_wire as fw
from mesh.testing import shared_payload_wire as spw
from transport import Envelope, Outbox, Payload, close_context, decode, encode, get_logger

MEGABYTE = os.urandom(1 << 20)
ROUNDS = 20


def calls_per_run(work: Callable[[], Any], between: Callable[[], None] = lambda: None) -> float:
    """Function calls (Python and C) one run of `work` makes, averaged over `ROUNDS` runs
    (`between` runs after each, uncounted)."""
    counted = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            counted[0] += 1

    work()
    between()
    for _ in range(ROUNDS):
        sys.setprofile(profile)
        work()
        sys.setprofile(None)
        between()
    return counted[0] / ROUNDS


def proc_side() -> tuple[float, float]:
    """(calls to read an ArenaCall of 1 MB, calls to read a plain call of nothing)."""
    message = wire.CallActor(7, "ipc:///tmp/x/caller", "actor", "length", ("gpus",), (32,), 3)
    arena, maps = PayloadArena(), aw.ArenaMaps()
    placed = arena.put(message, Payload.dump(((MEGABYTE,), {})))
    assert placed is not None, "an empty arena takes 1 MB"
    arena_frames, plain_frames = encode(placed), encode(message, Payload.dump(((b"",), {})))

    def read_arena_call() -> Any:
        header = decode(arena_frames).header
        payload = maps.payload(header)
        return header.message, payload.load()

    def read_plain_call() -> Any:
        envelope = decode(plain_frames)
        return envelope.header, envelope.payload.load()  # type: ignore[union-attr]

    return calls_per_run(read_arena_call), calls_per_run(read_plain_call)


def shared_side(tensor: Any) -> float:
    """Calls to read a SharedCall of `tensor`, each time a new one (a new file: its header is
    new to the proc), as for every call; its mapping is let go after each read."""
    payload = Payload.dump(((tensor,), {}))
    ids = iter(range(1, 1 << 30))
    files: list[int] = []
    frames: list[Any] = []

    def share() -> None:
        for fd in files:
            os.close(fd)
        message = wire.CallActor(next(ids), "ipc:///tmp/x/c", "actor", "length", ("g",), (32,), 3)
        fd, shared = spw.share_payload(message, payload)
        files[:], frames[:] = [fd], encode(shared)

    def read_shared_call() -> Any:
        header = decode(frames).header
        return header.message, spw.mapped_payload(header).load()

    share()
    try:
        return calls_per_run(read_shared_call, share)
    finally:
        os.close(files[0])


@contextlib.contextmanager
def relay_to(procs: int) -> Iterator[tuple[FanOutRelay, str, list[zmq.Socket[Any]]]]:
    """An agent's relay to `procs` procs, each a PULL socket bound in a private folder."""
    folder = tempfile.mkdtemp(prefix="mvt-arena-calls-")
    context: zmq.Context[Any] = zmq.Context()
    sockets: list[zmq.Socket[Any]] = []
    outbox = Outbox(context)
    try:
        table = ProcTable()
        for rank in range(procs + 1):  # the last one: the caller
            socket = context.socket(zmq.PULL)
            socket.setsockopt(zmq.LINGER, 0)
            socket.bind(f"ipc://{folder}/p{rank}")
            sockets.append(socket)
            if rank < procs:
                spec = wire.ProcSpec(f"p{rank}", "m", ("gpus",), (procs,), rank)
                address = f"ipc://{folder}/p{rank}"
                table.add(ProcRecord(spec, "ipc://owner", address, 5.0, 5.0, connected=True))
        log = get_logger("bench.arena_calls")
        yield FanOutRelay(table, outbox, f"ipc://{folder}/agent", log), folder, sockets
    finally:
        outbox.close(0)
        for socket in sockets:
            socket.close(0)
        close_context(context)
        shutil.rmtree(folder, ignore_errors=True)


def agent_side(procs: int, payload: Payload) -> float:
    """Calls the agent's relay makes per proc to deliver one call of `payload` to `procs`."""
    with relay_to(procs) as (relay, folder, sockets):
        targets = (tuple(f"p{rank}" for rank in range(procs)), tuple(range(procs)))
        calls = iter(range(1, 1 << 30))  # the caller's call ids, and the relay's (both from 1)
        relayed = iter(range(1, 1 << 30))

        def fan_out() -> None:
            caller = f"ipc://{folder}/p{procs}"
            message = wire.CallActor(next(calls), caller, "a", "ep", ("gpus",), (procs,), 0)
            relay.handle(Envelope(fw.FanOut(message, *targets), payload))
            relay.flush()

        def answer_all() -> None:  # every proc answers: its slot is free for the next call
            relay_id = next(relayed)
            for rank in range(procs):
                relay.handle(Envelope(wire.Reply(relay_id, rank), Payload.dump(rank)))
            relay.flush()
            for socket in sockets:
                while socket.poll(0):
                    socket.recv(copy=False)

        return calls_per_run(fan_out, answer_all) / procs


def _megabyte_tensor() -> Any:
    """A tensor of 1 MB, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    return torch.frombuffer(bytearray(MEGABYTE), dtype=torch.float32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=32)
    procs = parser.parse_args().procs
    arena_call, plain_call = proc_side()
    print(f"proc: reading an ArenaCall of 1 MB     {arena_call:7.1f} calls")
    print(f"proc: reading a plain call of nothing  {plain_call:7.1f} calls (floor)")
    tensor = _megabyte_tensor()
    if tensor is not None:
        print(f"proc: reading a SharedCall of 1 MB     {shared_side(tensor):7.1f} calls (tensor)")
    large = agent_side(procs, Payload.dump(((MEGABYTE,), {})))
    small = agent_side(procs, Payload.dump(((b"x" * 100,), {})))
    print(f"agent: a 1 MB call to {procs}, per proc     {large:7.1f} calls")
    if tensor is not None:
        shared = agent_side(procs, Payload.dump(((tensor,), {})))
        print(f"agent: a 1 MB tensor to {procs}, per proc   {shared:7.1f} calls (SharedCall)")
    print(f"agent: a small call to {procs}, per proc    {small:7.1f} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
