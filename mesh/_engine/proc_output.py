"""Where procs' lines arrive at their owner, with their source, and what happens to them there.

The lines of a proc mesh whose owner called `ProcMesh.logging_option` come here
(`ProcOutput`, through the procs' host agents), not to the agents' own output. Per mesh they
are printed to this process's stdout/stderr at once, or aggregated over a window (identical
lines of many ranks shown once, with their ranks), or held back (`stream_to_client=False`).
One writer thread prints, so that a slow terminal never holds the event loop. Every other way
of keeping lines (per-rank files, a log CLI) plugs in at `OutputSink.on_output`.
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from mesh._engine.future import Future, LoopPump
from mesh._engine.log_messages import OutputSynced, ProcOutput, SyncOutput
from mesh._engine.notebook import write_output
from mesh._engine.ownership import Ownership
from mesh._engine.peers import ProcPeer
from mesh._engine.proc_lines import Aggregator, RankedLine
from transport import Envelope

#: How long a sync of the procs' output waits for their host agents (a lost agent never answers).
SYNC_TIMEOUT_S = 30.0
#: Batches of lines queued for the writer thread at most; beyond, they are dropped and counted.
_MAX_QUEUED = 2_000


@dataclass(frozen=True)
class LogMode:
    """What this process does with the lines of one proc mesh."""

    stream_to_client: bool
    aggregate_window_s: float | None
    #: Whether lines that differ only in their numbers are aggregated too (`proc_lines`).
    aggregate_similar: bool = True


class SinkHost(LoopPump, Protocol):
    """What the sink needs of the runtime (its loop: a sync waited for on the loop thread
    receives the agents' answers meanwhile)."""

    def address_for(self, peer: str | None, home: Any = None) -> str:
        """This process's address to hand to the process at `peer` (`Runtime.address_for`)."""
        ...

    def send_message(self, address: str, header: Any, payload: Any = None) -> None: ...

    def call_soon_threadsafe(self, function: Any, *args: Any) -> None: ...

    def call_later(self, delay_s: float, function: Any, *args: Any) -> None: ...


class OutputSink:
    """The procs' lines that reach this process, per mesh as its `LogMode` says."""

    def __init__(self, host: SinkHost, ownership: Ownership) -> None:
        self._host = host
        self._ownership = ownership
        self._modes: dict[str, LogMode] = {}
        self._syncs: dict[str, list[Any]] = {}  # token -> [agents left, agents, future]
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[Any, ...]] = queue.Queue(_MAX_QUEUED)
        self._writer: threading.Thread | None = None
        self.dropped = 0

    def set_mode(self, mesh_key: str, mode: LogMode) -> None:
        self._modes[mesh_key] = mode

    def on_output(self, envelope: Envelope) -> None:
        """Lines from a proc (on the loop thread): hand them to the writer, or hold them back."""
        header: ProcOutput = envelope.header
        peer = self._ownership.peer(header.proc_id)
        mode = self._modes.get(peer.mesh_key) if peer is not None else None
        if mode is not None and not mode.stream_to_client:
            return  # held back at the client, as asked
        rank = _rank_of(peer)
        lines = [RankedLine(header.stream, text, header.source, rank) for text in header.lines]
        key = peer.mesh_key if peer is not None else header.source
        window = mode.aggregate_window_s if mode is not None else None
        similar = mode is None or mode.aggregate_similar
        self._put(("lines", key, window, similar, lines), len(lines))

    def sync(self, peers: list[ProcPeer], forward: bool, quiet: bool = False) -> Future[None]:
        """Ask the agents of `peers` to relay what those procs printed so far (and to forward
        their lines here, or not, or, `quiet`, to keep them in their log files only, from now
        on); done once those lines are printed. Fails
        with TimeoutError naming the agents that did not answer within `SYNC_TIMEOUT_S`."""
        by_agent: dict[str, list[str]] = {}
        for peer in peers:
            if peer.alive and peer.agent is not None:
                by_agent.setdefault(peer.agent, []).append(peer.proc_id)
        done: Future[None] = Future(self._host, "the sync of the procs' output")
        if not by_agent:
            done.set_result(None)
            return done
        token = secrets.token_hex(8)
        with self._lock:
            self._syncs[token] = [len(by_agent), sorted(by_agent), done]
        for agent, proc_ids in by_agent.items():
            request = SyncOutput(
                tuple(proc_ids), forward, self._host.address_for(agent), token, quiet
            )
            self._host.send_message(agent, request)
        self._host.call_soon_threadsafe(self._host.call_later, SYNC_TIMEOUT_S, self._expire, token)
        return done

    def on_synced(self, envelope: Envelope) -> None:
        """An agent relayed what its procs printed before (on the loop thread, after them)."""
        header: OutputSynced = envelope.header
        with self._lock:
            waiting = self._syncs.get(header.token)
            if waiting is None:
                return
            waiting[0] -= 1
            if waiting[0] > 0:
                return
            del self._syncs[header.token]
        self._put(("flush", waiting[2]))

    def close(self, timeout_s: float = 2.0) -> None:
        """Print what is still aggregated (the program ends), waiting at most `timeout_s`."""
        if self._writer is None:
            return
        flushed: Future[None] = Future(description="the last proc output")
        self._put(("flush", flushed))
        with contextlib.suppress(TimeoutError):
            flushed.get(timeout=timeout_s)

    def _expire(self, token: str) -> None:
        with self._lock:
            waiting = self._syncs.pop(token, None)
        if waiting is not None:
            waiting[2].set_exception(
                TimeoutError(
                    f"{waiting[0]} of host agents {waiting[1]} did not relay their procs' "
                    f"output within {SYNC_TIMEOUT_S:g} s: they are lost, or too busy"
                )
            )

    def _put(self, item: tuple[Any, ...], lines: int = 0) -> None:
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name="meshvisor-output")
                self._writer.daemon = True
                self._writer.start()
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped += lines

    def _write(self) -> None:
        """The writer thread: print lines at once, or when their mesh's window closes."""
        windows: dict[str, tuple[float, Aggregator]] = {}
        while True:
            if self.dropped:  # the queue was full: say how many lines never made it
                dropped, self.dropped = self.dropped, 0
                _print(
                    2,
                    f"[meshvisor] {dropped} proc lines were dropped: they came faster "
                    "than this process could print them",
                )
            now = time.monotonic()
            due = min((deadline for deadline, _ in windows.values()), default=None)
            try:
                item = self._queue.get(timeout=None if due is None else max(0.0, due - now))
            except queue.Empty:
                item = ("due",)
            if item[0] == "lines":
                _take_lines(windows, now, *item[1:])
                continue
            closing = [k for k, (d, _) in windows.items() if item[0] == "flush" or d <= now]
            for key in closing:
                for stream, text in windows.pop(key)[1].take():
                    _print(stream, text, key)
            if item[0] == "flush":
                item[1].set_result(None)


def _take_lines(
    windows: dict[str, tuple[float, Aggregator]],
    now: float,
    key: str,
    window: float | None,
    similar: bool,
    lines: list[RankedLine],
) -> None:
    """Print `lines` at once (no `window`), or add them to their mesh's open window."""
    if window is None:
        _print(lines[0].stream, "\n".join(line.shown_alone() for line in lines), key)
        return
    if key not in windows:
        windows[key] = (now + window, Aggregator(similar))
    aggregator = windows[key][1]
    for line in lines:
        aggregator.add(line)


def _rank_of(peer: ProcPeer | None) -> tuple[tuple[str, int], ...]:
    if peer is None:
        return ()
    return tuple(dict(peer.point).items())


def _print(stream: int, text: str, mesh_key: str | None = None) -> None:
    """Write lines to this process's stdout (1) or stderr (2), in a notebook under the cell
    that called their mesh `mesh_key`; a closed one is ignored."""
    target = sys.stdout if stream == 1 else sys.stderr
    with contextlib.suppress(OSError, ValueError, AttributeError):
        write_output(target, text + "\n", mesh_key)
