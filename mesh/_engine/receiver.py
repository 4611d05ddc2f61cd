"""`Receiver`: in a proc, a worker thread reads the inbox and runs the first sync call itself.

The event loop thread used to receive every message and hand each call of a sync endpoint to
a worker thread: two wake-ups per call (the loop's, then the worker's), which on a busy
machine cost more than the call. Here one worker thread at a time, the receiver, waits on the
inbox. It queues the messages for actors (calls, spawns, stops) in their mailboxes itself; the
first sync work this asks for (an idle actor's call) it runs itself, answering on its own, and
then receives again; further work goes to other worker threads as before. A call of a header
seen before comes as its route (`lone_calls.py`): no envelope, and one alone for an idle actor
runs at once. Every other message it hands to the event loop in arrival order
(`EventLoop.hand`), and while the loop has not finished those, messages for actors go the same
way, so nothing overtakes what came before it.

A receiver busy with a call still holds the inbox. The watch thread hands the inbox to another
worker thread when the task has run `HAND_OVER_S` and is stuck (`HolderCheck`: asleep, or
computing with no call ending), so a long or blocking sync endpoint (a `get()` on an actor of
this proc, `breakpoint()`, a collective) never stops the proc from receiving, while a long
drain of short calls keeps the inbox. The receiver notes when each task starts and arms the
watch's alarm only when it is not armed already (`mesh/_engine/alarm.py`: no thread wakes
for that); when it goes off, the watch arms it again for what is left of the current task's
`HAND_OVER_S`, or looks at the task, if a task runs. So the watch wakes at most once per
`HAND_OVER_S` while calls keep coming, never once per call, and a call costs no system call
for the watch (arming and disarming for each cost two). When calls come sparsely (a task
started more than `_SPARSE_S` after the one before, as in calls to a whole mesh one after the
other), the receiver disarms the alarm before it waits again: otherwise it would go off in
the idle proc after each call, a wake-up that costs far more than the system call.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from mesh._engine.alarm import new_alarm
from mesh._engine.hand_over import HolderCheck
from mesh._engine.lone_calls import LoneCalls
from mesh._engine.messages import Wake
from mesh._engine.workers import Workers
from transport import Envelope, Keyed, KeyedInbox, TransportError, get_logger

#: How long a task may run on the receiver before the watch looks whether it is stuck; also the
#: CPU time a task may use with no call ending before another thread takes over the inbox.
HAND_OVER_S = 0.005
#: The most messages taken in one pass before the receiver runs what the pass asked for.
_PASS_MESSAGES = 256
#: How long a task that the watch finds asleep (between naps) may go with no call ending.
_NAPPING_S = 10 * HAND_OVER_S
#: Tasks that start further apart than this: the alarm is disarmed before waiting (see above).
_SPARSE_S = HAND_OVER_S / 5
#: The longest the receiver waits in one receive (`stop` wakes it sooner, with a `Wake`).
_WAIT_MS = 1000

Task = tuple[Callable[..., object], tuple[Any, ...]]


class LoopHand(Protocol):
    """What the receiver needs of the event loop: handing it messages, in order."""

    def hand(self, envelopes: list[Envelope]) -> None: ...
    def handing(self) -> bool: ...


class Receiver:
    """Reads a proc's inbox on worker threads (see the module's docstring)."""

    def __init__(
        self,
        inbox: KeyedInbox,
        workers: Workers,
        loop: LoopHand,
        direct: Mapping[type, Callable[[Envelope], None]],
        lone: LoneCalls,
        flush: Callable[[], None],
        wake: Callable[[], None],
    ) -> None:
        self._inbox = inbox
        self._lone = lone  # lone calls of known routes, run here when their actor is idle
        self._workers = workers
        self._loop = loop
        self._direct = direct  # the handlers of the messages dispatched here (actors')
        self._flush = flush  # sends the messages waiting in batches, before waiting
        self._wake = wake  # sends a `Wake` to the inbox: ends the receiver's wait
        #: Run (on this thread, mid-pass) for each `Wake` received: what other threads asked.
        self.on_wake: Callable[[], None] = _nothing
        # guards everything below; taken as the plain lock where no one waits or is notified
        # (a Condition's own `with` costs two Python calls, twice per message)
        self._lock = threading.Lock()
        self._role = threading.Condition(self._lock)
        self._holder: int | None = None  # the thread that may read the inbox
        self._holder_native = 0  # its kernel thread id
        self._check: HolderCheck | None = None  # the watch's look at the holder's current task
        self._check_for: float | None = None  # (the `_task_since` of that task)
        #: How many times the watch gave the inbox to another thread (a stuck task).
        self.hand_overs = 0
        #: How many times the alarm went off with no task to look at (a needless wake-up).
        self.idle_alarms = 0
        self._in_pass = False  # the holder is reading the inbox now
        self._task_since: float | None = None  # when the holder's current task started
        self._armed = False  # the alarm will go off (the watch has not seen it go off yet)
        self._last_task = 0.0  # when the holder's last task started
        self._sparse = False  # that task started `_SPARSE_S` after the one before it
        self._stopping = False
        self._alarm = new_alarm()  # expires when the holder's task has run HAND_OVER_S
        self._alarm_open = True  # until the watch closes it (under `_lock`)
        self._log = get_logger("mesh.receiver")

    def start(self) -> None:
        threading.Thread(target=self._watch, name="meshvisor-receiver-watch", daemon=True).start()
        self._workers.submit(self._serve)

    def stop(self) -> None:
        """No thread reads the inbox once this returns (the inbox may then be closed)."""
        with self._lock:
            self._stopping = True
        self._wake()  # (not under the lock: it takes the outbox's)
        with self._role:
            self._role.wait_for(lambda: not self._in_pass, timeout=10)
            if self._alarm_open:  # (the watch, woken meanwhile, may have closed it)
                self._alarm.ring()  # the watch sees `_stopping`, closes the alarm and ends

    def step_aside(self) -> None:
        """The calling thread is about to block: if it holds the inbox (it runs a call it
        received), another worker thread takes the inbox now, not when the watch would."""
        me = threading.get_ident()
        if self._holder != me:
            return
        with self._lock:
            if self._holder != me or self._in_pass or self._stopping:
                return
            self._holder, self._task_since = None, None
            self._alarm.disarm()
            self._armed = False
        self._workers.submit(self._serve)

    def run_if_idle(self, function: Callable[[], object]) -> bool:
        """Run `function` here if no other thread is inside the inbox: none is in a pass, or
        this one holds it (it runs what it received); no pass begins meanwhile. False when
        another thread reads it (`reader_calls.py`)."""
        with self._lock:
            if self._stopping:
                raise TransportError("this proc is stopping, its inbox takes no new address.")
            if self.read_elsewhere():
                return False
            function()
            return True

    def read_elsewhere(self) -> bool:
        """Whether a thread other than this one may be inside the inbox now (in a pass)."""
        return self._in_pass and self._holder != threading.get_ident()

    # -- the receiving thread --------------------------------------------------------------------

    def _serve(self) -> None:
        """Worker thread: receive, and run what a pass asked for, while this thread holds the
        inbox (until the watch gives it to another thread, or the proc stops)."""
        me = threading.get_ident()
        with self._lock:
            if self._holder is not None or self._stopping:
                return
            self._holder, self._holder_native = me, threading.get_native_id()
        while self._begin_pass(me):
            task = None
            try:
                task = self._receive_pass()
            finally:
                self._end_pass(task is not None)
            if task is not None:  # `run_task`, inlined: once per call
                try:
                    task[0](*task[1])
                except BaseException:
                    self._log.exception("worker_task_failed")

    def _begin_pass(self, me: int) -> bool:
        """Whether this thread still holds the inbox (then its pass begins, and the task it
        ran before has ended: the alarm stays armed, the watch finds no task and waits; if
        calls come sparsely, it is disarmed, so that it does not wake the idle proc)."""
        with self._lock:
            if self._holder != me:
                return False
            self._task_since = None
            if self._stopping:
                self._holder = None
                return False
            if self._sparse and self._armed:  # (the watch closes it only once stopping)
                self._alarm.disarm()
                self._armed = False
            self._in_pass = True
            return True

    def _end_pass(self, has_task: bool) -> None:
        """Note that the pass ended (and its task starts: the watch's alarm is armed)."""
        with self._lock:  # the Condition's lock: `notify_all` below holds it
            self._in_pass = False
            self._task_since = None
            if has_task and not self._stopping:
                now = self._task_since = time.monotonic()
                self._sparse, self._last_task = now - self._last_task > _SPARSE_S, now
                if not self._armed:
                    self._alarm.arm(HAND_OVER_S)
                    self._armed = True
            if self._stopping:
                self._role.notify_all()

    def _receive_pass(self) -> Task | None:
        """Wait for messages, dispatch up to a pass of them; the sync work they asked for
        first, for this thread to run (None if none)."""
        inbox = self._inbox
        try:
            self._flush()
            # one blocking receive, no poll before it: `stop` ends it with a `Wake`
            got = inbox.receive_keyed(_WAIT_MS)
        except Exception:  # a bug, or a closed socket: keep going, but not in a tight loop
            self._log.exception("receive_failed")
            time.sleep(0.1)
            return None
        if got is None or self._stopping:
            return None
        if isinstance(got, Envelope):  # (a batch's first message is one too)
            return self._dispatch_pass(got)
        # a lone call of a known route, alone: run on this thread if its actor is idle
        taken = self._lone.take(got, self._loop.handing())  # (raises nothing: no user code)
        return self._dispatch_pass(taken) if isinstance(taken, Envelope) else taken

    def _dispatch_pass(self, first: Keyed | Envelope) -> Task | None:
        """Dispatch `first` and what came with it (up to a pass of messages)."""
        loop, inbox, lone = self._loop, self._inbox, self._lone
        got: Keyed | Envelope | None = first
        to_loop: list[Envelope] = []
        # only this thread hands the loop messages: once it has none left, none come mid-pass
        handing = loop.handing()
        self._workers.hold_first()
        try:
            left, batched = _PASS_MESSAGES, False
            while got is not None:
                envelope = got if isinstance(got, Envelope) else lone.take(got, handing)
                if isinstance(envelope, tuple):  # an idle actor's call: the thread's first task
                    self._workers.submit(envelope[0], *envelope[1])
                elif envelope is not None:  # (None: a call queued in its actor's mailbox)
                    handing = self._dispatch(envelope, handing, to_loop)
                left -= 1
                if not left:
                    break
                # the socket is asked for more only after a batch: a lone message's sender
                # waits for its answer (a round trip), and asking costs two system calls for
                # nothing; whatever came meanwhile is the next pass's
                if (got := inbox.received_keyed()) is not None:
                    batched = True
                elif batched:
                    got = inbox.receive_keyed(0)
                else:
                    break
        except Exception:  # what was received and what it asked for still go on
            self._log.exception("receive_failed")
        finally:
            task = self._workers.take_held()
            if to_loop:
                loop.hand(to_loop)
        return task

    def _dispatch(self, envelope: Envelope, handing: bool, to_loop: list[Envelope]) -> bool:
        """Run the handler of a message for actors, or hand `envelope` to the loop (in
        `to_loop`); whether messages go to the loop from now on (`handing`)."""
        kind = type(envelope.header)
        handler = None if handing else self._direct.get(kind)
        if handler is not None:
            try:
                handler(envelope)
            except Exception:  # the next messages still go on
                self._log.exception("message_handling_failed", kind=kind.__name__)
        elif kind is Wake:
            self.on_wake()  # (raises nothing: `ReaderCalls.run_waiting`)
        else:
            to_loop.append(envelope)
            return True  # what follows goes the same way, to keep the order
        return handing

    # -- the watch ---------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Give the inbox to another thread when the receiver's task runs too long."""
        alarm = self._alarm
        while True:
            alarm.wait()
            with self._lock:
                self._armed = False
                if self._stopping:
                    alarm.close()
                    self._alarm_open = False
                    return
                since = self._task_since
                if since is None or self._in_pass:  # the next task arms it
                    self.idle_alarms += 1
                    continue
                left = since + HAND_OVER_S - time.monotonic()
                if left <= 0:  # the task has run HAND_OVER_S: is it stuck?
                    stuck = self._look_at_holder(since)
                    if not stuck:
                        left = _look_window()
                if left > 0:  # (or the task running started after the alarm was armed)
                    alarm.arm(left)
                    self._armed = True
                    continue
                self._holder, self._task_since = None, None
                self.hand_overs += 1
            self._workers.submit(self._serve)

    def _look_at_holder(self, since: float) -> bool | None:
        """Whether the holder's task that started at `since` is stuck (see `HolderCheck`)."""
        if self._check_for != since or self._check is None:
            assert self._holder is not None
            holder, native = self._holder, self._holder_native
            steps = self._workers.steps_of(holder)
            self._check = HolderCheck(holder, native, steps, HAND_OVER_S, _NAPPING_S)
            self._check_for = since
        return self._check.stuck()


def _nothing() -> None:
    """What a `Wake` runs when nothing else is set (`Receiver.on_wake`)."""


def _look_window() -> float:
    """How long the watch waits between two looks at a task: longer than the GIL's switch
    interval, so that a thread waiting for the GIL shows some CPU time (it wakes at each
    interval) and only a thread asleep on something else shows none."""
    return 1.5 * max(HAND_OVER_S, sys.getswitchinterval())
