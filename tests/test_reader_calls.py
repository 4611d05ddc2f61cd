"""Binding an inbox only where no other thread reads it (mesh/_engine/reader_calls.py): zmq
sockets are not thread-safe, so a thread that asks while another reads has the reader bind.

On an event loop in this process (the client's reader) and in procs (the receiver, a worker
thread, also while the call it received blocks it). Real sockets and threads; the procs are
stopped and the socket folders removed.
"""

from __future__ import annotations

import functools
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import bind_actors as ba
import pytest
from conftest import RUN_BASE
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh import this_host
from mesh.testing import EventLoop, ReaderCalls, wire
from transport import (
    Envelope,
    KeyedInbox,
    Outbox,
    Payload,
    TransportError,
    close_context,
    encode,
    new_context,
)

T = 30.0


@dataclass
class Loop:
    """An event loop reading an inbox (as the client's does), and a raw peer's outbox."""

    inbox: KeyedInbox
    outbox: Outbox
    loop: EventLoop
    calls: ReaderCalls
    folder: str
    received: queue.Queue[tuple[int, Any]]

    def thread(self) -> int:
        """The loop's thread."""
        found: queue.Queue[int] = queue.Queue()
        self.loop.call_soon(lambda: found.put(threading.get_ident()))
        return found.get(timeout=T)

    def ask(self, function: Callable[[], Any], what: str = "listen") -> Any:
        return self.calls.call(self.loop, function, what)


def _loop(wait_s: float) -> Iterator[Loop]:
    folder = tempfile.mkdtemp(prefix="rc", dir=RUN_BASE)
    context = new_context()
    inbox = KeyedInbox(context, f"ipc://{folder}/in")
    outbox = Outbox(context)
    calls = ReaderCalls(lambda: outbox.send(inbox.address, encode(wire.Wake(), None)), wait_s)
    received: queue.Queue[tuple[int, Any]] = queue.Queue()

    def dispatch(envelope: Envelope) -> None:
        if type(envelope.header) is wire.Wake:
            calls.run_waiting()
        else:
            received.put((threading.get_ident(), envelope))

    loop = EventLoop(inbox, dispatch, os.getpid(), outbox.flush)
    loop.start_in_thread()
    try:
        yield Loop(inbox, outbox, loop, calls, folder, received)
    finally:
        loop.stop()
        calls.close()
        outbox.close(linger_ms=0)
        inbox.close()
        close_context(context)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def reader() -> Iterator[Loop]:
    yield from _loop(T)


@pytest.fixture(scope="module")
def shared_reader() -> Iterator[Loop]:
    yield from _loop(T)


@pytest.fixture
def slow_reader() -> Iterator[Loop]:
    """A loop whose askers give up after 0.2 s."""
    yield from _loop(0.2)


def _bind_noting_thread(inbox: KeyedInbox, address: str) -> Callable[[], tuple[int, str]]:
    return lambda: (threading.get_ident(), inbox.listen_also(address))


def test_a_bind_asked_off_the_loop_thread_runs_on_it_and_its_address_receives(
    reader: Loop,
) -> None:
    """The loop thread binds (between two receives), and a tcp peer's message arrives there."""
    binder, address = reader.ask(_bind_noting_thread(reader.inbox, "tcp://127.0.0.1:*"))
    assert binder == reader.thread() != threading.get_ident()
    assert address.startswith("tcp://127.0.0.1:")
    reader.outbox.send(address, encode(wire.PortMessage(5, -1, "value"), Payload.dump("tcp")))
    on, envelope = reader.received.get(timeout=T)
    assert on == binder
    assert envelope.header.port_id == 5


def test_a_bind_asked_on_the_loop_thread_runs_there_at_once(reader: Loop) -> None:
    """The loop thread asking (a handle unpickled in a handler) binds itself: no deadlock."""
    answers: queue.Queue[Any] = queue.Queue()
    also = f"ipc://{reader.folder}/also"
    reader.loop.call_soon(lambda: answers.put(reader.ask(_bind_noting_thread(reader.inbox, also))))
    binder, address = answers.get(timeout=T)
    assert binder == reader.thread()
    assert address == also


def test_a_bind_the_reader_cannot_get_to_ends_with_an_error_and_never_runs(
    slow_reader: Loop,
) -> None:
    """The loop is busy past the asker's wait: the asker is told why, and its bind is
    withdrawn (the loop, free again, does not run it)."""
    busy, ran = threading.Event(), threading.Event()
    slow_reader.loop.call_soon(busy.wait, T)
    with pytest.raises(TransportError, match=r"did not get to it within 0\.2 s"):
        slow_reader.ask(ran.set, "listen on tcp://127.0.0.1")
    busy.set()
    assert slow_reader.ask(threading.get_ident) == slow_reader.thread()  # it runs again
    assert not ran.is_set()


def test_a_bind_asked_of_a_closed_inbox_ends_with_an_error(slow_reader: Loop) -> None:
    """What waits when the inbox closes, and what is asked after, ends with an error."""
    busy, failed = threading.Event(), queue.Queue[BaseException]()
    slow_reader.loop.call_soon(busy.wait, T)

    def ask() -> None:
        try:
            slow_reader.ask(lambda: None)
        except TransportError as exc:
            failed.put(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    slow_reader.calls.close()
    asker.join(T)
    busy.set()
    assert "closed" in str(failed.get(timeout=T))
    with pytest.raises(TransportError, match="cannot listen: this process's inbox is closed"):
        slow_reader.ask(lambda: None)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.sampled_from(["loop", "thread", "message"]), min_size=1, max_size=12))
def test_whatever_threads_ask_amid_messages_each_runs_once_on_the_loop_thread(
    shared_reader: Loop, steps: list[str]
) -> None:
    """Asks from the loop thread and from other threads at once, among messages the loop
    receives meanwhile: each function runs once, on the loop thread, and every ask ends."""
    reader, loop_thread = shared_reader, shared_reader.thread()
    ran: queue.Queue[tuple[int, int]] = queue.Queue()
    threads, sent = [], 0
    for i, step in enumerate(steps):
        ask = functools.partial(reader.ask, functools.partial(_note, ran, i))
        if step == "loop":
            reader.loop.call_soon(ask)
        elif step == "thread":
            threads.append(threading.Thread(target=ask))
            threads[-1].start()
        else:
            reader.outbox.send(reader.inbox.address, encode(wire.PortMessage(i, -1, "value")))
            sent += 1
    runs = sorted(ran.get(timeout=T) for step in steps if step != "message")
    assert runs == [(i, loop_thread) for i, step in enumerate(steps) if step != "message"]
    for thread in threads:
        thread.join(T)
    for _ in range(sent):
        reader.received.get(timeout=T)


def _note(ran: queue.Queue[tuple[int, int]], i: int) -> None:
    ran.put((i, threading.get_ident()))


# -- in procs: the receiver ---------------------------------------------------------------


@pytest.fixture
def actors() -> Iterator[tuple[Any, Any]]:
    """(binder, blocker): two actors of one new proc, which listens on ipc only so far."""
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="binds")
    try:
        yield procs.spawn("binder", ba.Binder), procs.spawn("blocker", ba.Blocker)
    finally:
        procs.stop().get(timeout=T)


def _reaches_over_tcp(binder: Any, address: str) -> None:
    """A raw tcp peer's message reaches a port of the proc at `address`."""
    port_id = binder.open_port.call_one().get(timeout=T)
    context = new_context()
    outbox = Outbox(context)
    try:
        outbox.send(address, encode(wire.PortMessage(port_id, -1, "value"), Payload.dump("hi")))
        assert binder.next_value.call_one().get(timeout=T) == "hi"
    finally:
        outbox.close(linger_ms=0)
        close_context(context)


def test_a_proc_binds_where_no_other_thread_reads_when_another_thread_asks(
    actors: tuple[Any, Any],
) -> None:
    """The receiver binds (or the asker, while no pass is underway)."""
    binder, _ = actors
    address, bound_on, alone, _ = binder.bind_off_reader.call_one().get(timeout=T)
    assert bound_on is not None and alone
    _reaches_over_tcp(binder, address)


def test_a_proc_binds_at_once_when_its_receiver_asks(actors: tuple[Any, Any]) -> None:
    """The receiver runs the call it received and asks itself: it binds there, no deadlock."""
    binder, _ = actors
    binder.bind_here.call_one(False).get(timeout=T)  # its route is known from now on
    address, bound_on, alone, asker = binder.bind_here.call_one(True).get(timeout=T)
    assert bound_on == asker and alone
    _reaches_over_tcp(binder, address)


def test_a_proc_binds_while_its_receiver_is_blocked_in_a_task(actors: tuple[Any, Any]) -> None:
    """The thread that received a blocking call keeps it; the thread that took the inbox
    over binds (or the asker itself, between two passes), never the blocked one."""
    binder, blocker = actors
    held = blocker.hold.call_one(T)
    assert binder.wait_holding.call_one(T).get(timeout=T)
    address, bound_on, alone, _ = binder.bind_off_reader.call_one().get(timeout=T)
    binder.release.call_one().get(timeout=T)
    assert bound_on is not None and bound_on != held.get(timeout=T) and alone
    _reaches_over_tcp(binder, address)
