"""`debug`: the debug prompt, in the client's terminal or in ``meshvisor debug``.

At ``meshvisor_dbg>`` the user lists the calls paused in ``breakpoint()``, attaches to one
(each line then goes to its pdb, until ``detach`` or the call goes on), casts one pdb command
to several ranks, or lets them all go on. Leaving (``quit``, end of input, or the front end
dying) releases nothing and resumes nothing: paused calls stay paused, for the next front end.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from mesh.tooling import PausedCall
from observe._debug_agents import allocation_agents
from observe._debug_commands import (
    HELP,
    Attach,
    Cast,
    Command,
    ContinueAll,
    Help,
    ListPaused,
    Quit,
    parse_command,
)
from observe._debug_link import DebugClient

TOP_PROMPT = "meshvisor_dbg> "


def debug(
    *,
    agents: Sequence[str] | None = None,
    allocation: str | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
) -> None:
    """Open the debug prompt on calls paused in ``breakpoint()`` (see ``docs/debugger.md``).

    It asks the host agents `agents`, those of `allocation`, or by default the local agents
    of this user's running clients. Reads commands from `stdin` (default: the terminal) and
    writes to `stdout`; returns on ``quit`` or at the end of the input.
    """
    if allocation is not None:
        agents = [*(agents or ()), *allocation_agents(allocation)]
    client = DebugClient(agents)
    try:
        DebugPrompt(client, *terminal_io(stdin, stdout)).run()
    finally:
        client.close()


def terminal_io(
    stdin: TextIO | None, stdout: TextIO | None
) -> tuple[Callable[[str], str | None], Callable[[str], None]]:
    """The prompt's line reader and writer over these streams (default: the terminal)."""
    out = stdout or sys.stdout
    return _reader(stdin or sys.stdin, out), _writer(out)


class DebugPrompt:
    """The command loop over one `DebugClient`."""

    def __init__(
        self, client: DebugClient, read: Callable[[str], str | None], write: Callable[[str], None]
    ) -> None:
        self._client = client
        self._read = read
        self._write = write
        #: True while `run` runs: the time when an ending signal may interrupt it.
        self.running = False

    def run(self) -> None:
        self.running = True
        try:
            self._loop()
        finally:
            self.running = False

    def _loop(self) -> None:
        self._write("meshvisor debugger: `list` shows the paused calls, `help` the commands\n")
        while (line := self._read_or_leave(TOP_PROMPT)) is not None:
            try:
                command = parse_command(line)
            except ValueError as error:
                self._write(f"{error}\n")
                continue
            if isinstance(command, Quit):
                return
            if command is not None:
                self._run_interruptible(command)

    def _read_or_leave(self, prompt: str) -> str | None:
        """The next command; None at the end of the input or on Ctrl-C (leaving the prompt)."""
        try:
            return self._read(prompt)
        except KeyboardInterrupt:
            self._write("\n")
            return None

    def _run_interruptible(self, command: Command) -> None:
        try:
            self._run(command)
        except KeyboardInterrupt:
            self._write("\ninterrupted: a command sent runs on in its rank; `list` shows them\n")
        except (ValueError, TimeoutError) as error:
            self._write(f"{error}\n")

    def _run(self, command: Command) -> None:
        if isinstance(command, ListPaused):
            self._list()
        elif isinstance(command, Attach):
            self._attach(command)
        elif isinstance(command, Cast):
            self._cast(self._select(command.actor, command.ranks), command.command)
        elif isinstance(command, ContinueAll):
            self._cast(self._client.paused(), "continue")
        elif isinstance(command, Help):
            self._write(HELP)

    def _list(self) -> None:
        calls = self._client.paused()
        if not calls:
            self._write(f"no call is paused in the debugger{self._silent()}\n")
            return
        self._write(
            f"{'actor':<14} {'rank':>4}  {'class':<14} {'point':<14} {'host':<12} {'pid':>7}  "
            "where\n"
        )
        for call in calls:
            name = call.actor_mesh or call.proc_id
            where = f"{call.file}:{call.line} in {call.function}"
            self._write(
                f"{name:<14} {call.rank:>4}  {call.actor_class:<14} {call.point:<14} "
                f"{call.host:<12} {call.pid:>7}  {where}\n"
            )
        self._write(self._silent().lstrip("; ") + ("\n" if self._client.silent else ""))

    def _attach(self, command: Attach) -> None:
        calls = self._select(command.actor, frozenset({command.rank}))
        call = calls[0]
        name = f"{command.actor} {command.rank}"
        self._write(f"attached to {name} (`detach` comes back; paused calls: `list`)\n")
        self._write(call.where)
        while (line := self._read(f"(Pdb {name}) ")) is not None:
            if line.strip() == "detach":
                break
            output = self._client.send(call, line)
            self._write(output.text)
            if output.resumed:
                self._write(f"{name} goes on; detached\n")
                return
        self._write(f"detached from {name}: it stays paused\n")

    def _cast(self, calls: list[PausedCall], line: str) -> None:
        if not calls:
            self._write("no call is paused in the debugger\n")
            return
        for call, output in zip(calls, self._client.cast(calls, line)):
            state = " (goes on)" if output.resumed else ""
            self._write(f"--- {call.actor_mesh} {call.rank}{state} ---\n{output.text}")

    def _select(self, actor: str, ranks: frozenset[int] | None) -> list[PausedCall]:
        """The paused calls of actor mesh (or class) `actor` at `ranks` (None: all)."""
        paused = self._client.paused()
        calls = [
            call
            for call in paused
            if actor in (call.actor_mesh, call.actor_class)
            and (ranks is None or call.rank in ranks)
        ]
        if not calls:
            known = sorted({f"{c.actor_mesh} {c.rank}" for c in paused}) or ["none"]
            raise ValueError(
                f"no paused call of {actor!r} at ranks {sorted(ranks) if ranks else 'all'}; "
                f"paused now: {', '.join(known)}"
            )
        return calls

    def _silent(self) -> str:
        silent = self._client.silent
        return f"; no answer from {', '.join(silent)}" if silent else ""


def _reader(stream: TextIO, out: TextIO) -> Callable[[str], str | None]:
    """Read a line after a prompt: with line editing from a terminal, else echoed from
    `stream` (so a scripted dialogue reads like a terminal session); None at the end."""
    interactive = stream is sys.stdin and stream.isatty() and out is sys.stdout

    def read(prompt: str) -> str | None:
        if interactive:
            try:
                return input(prompt)
            except EOFError:
                return None
        line = stream.readline()
        out.write(prompt + line + ("" if line.endswith("\n") or not line else "\n"))
        return line.rstrip("\n") if line else None

    return read


def _writer(out: TextIO) -> Callable[[str], None]:
    def write(text: str) -> None:
        out.write(text)
        out.flush()

    return write
