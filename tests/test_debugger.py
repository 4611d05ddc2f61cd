"""The distributed debugger: ``breakpoint()`` in an endpoint pauses that call; a front end in
the client (`observe.debug`, `observe.DebugClient`) or ``meshvisor debug`` in another terminal
(driven through tmux) lists the paused ranks, attaches, runs pdb commands and casts them."""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from debug_actors import Exposed, Stepper
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from polling import wait_until
from test_agent_hardening import instances, raw_peer
from test_allocations import allocation  # noqa: F401  (a fixture: two tcp daemon agents)

from mesh import Future, attach, configured
from mesh.testing import debug_wire, local_agent
from observe import DebugClient, debug
from transport import encode

CALL_TIMEOUT_S = 60.0
PAUSE_TIMEOUT_S = 60.0
ROOT = Path(__file__).resolve().parents[1]


def wait_paused(count: int) -> list[Any]:
    """The paused calls, once there are `count` of them."""
    found: list[Any] = []
    with DebugClient() as client:

        def enough() -> bool:
            found[:] = client.paused()
            return len(found) >= count

        wait_until(enough, PAUSE_TIMEOUT_S, f"{count} calls paused in the debugger")
    return found


def dialogue(script: str) -> str:
    """Run `script` (one command a line) at the debug prompt; the transcript."""
    out = io.StringIO()
    debug(stdin=io.StringIO(script), stdout=out)
    return out.getvalue()


def after(transcript: str, prompt_line: str) -> str:
    """What the transcript shows after `prompt_line`, up to the next prompt."""
    rest = transcript.split(prompt_line + "\n", 1)[1]
    return rest.split("\n(Pdb", 1)[0].split("\nmeshvisor_dbg>", 1)[0]


@pytest.fixture
def steppers(make_procs: Callable[..., Any]) -> Any:
    return make_procs({"gpus": 2}).spawn("trainers", Stepper)


@pytest.mark.timeout(180)
def test_a_scripted_pdb_dialogue_on_two_paused_ranks(steppers: Any) -> None:
    results = steppers.step.call(4)
    paused = wait_paused(2)
    assert sorted(c.rank for c in paused) == [0, 1]
    transcript = dialogue(
        "list\n"
        "attach trainers 0\n"
        "where\n"
        "p a\n"
        "next\n"
        "p b\n"
        "detach\n"
        "cast trainers ranks(0,1) p a + 1\n"
        "cast trainers ranks(0:2) continue\n"
    )
    listed = after(transcript, "meshvisor_dbg> list")
    assert len([line for line in listed.splitlines() if line.startswith("trainers ")]) == 2
    assert "in step" in listed and "debug_actors.py" in listed and "Stepper" in listed
    attached = after(transcript, "meshvisor_dbg> attach trainers 0")
    assert "step()\n-> b = a + current_rank().rank" in attached  # where it stands
    where = after(transcript, "(Pdb trainers 0) where")
    assert "step()" in where and "-> b = a + current_rank().rank" in where
    assert "lanes.py" not in where  # the runtime's frames are not the user's
    assert after(transcript, "(Pdb trainers 0) p a").strip() == "40"
    assert "-> return b" in after(transcript, "(Pdb trainers 0) next")
    assert after(transcript, "(Pdb trainers 0) p b").strip() == "40"
    cast = after(transcript, "meshvisor_dbg> cast trainers ranks(0,1) p a + 1")
    assert cast.count("41") == 2 and "--- trainers 0 ---" in cast and "--- trainers 1 ---" in cast
    went_on = after(transcript, "meshvisor_dbg> cast trainers ranks(0:2) continue")
    assert "trainers 0 (goes on)" in went_on and "trainers 1 (goes on)" in went_on
    assert sorted(results.get(timeout=CALL_TIMEOUT_S).values()) == [40, 41]


@pytest.mark.timeout(180)
def test_an_async_endpoint_pauses_and_steps_into_a_function(steppers: Any) -> None:
    results = steppers.step_async.call(2)
    wait_paused(2)
    transcript = dialogue(
        "attach trainers 1\nstep\nstep\np value\nup\np a\nnext\nnext\ncontinue\nlist\n"
    )
    assert "doubled_plus_one()" in after(transcript, "(Pdb trainers 1) step")
    assert after(transcript, "(Pdb trainers 1) p value").strip() == "20"
    assert after(transcript, "(Pdb trainers 1) p a").strip() == "20"
    assert "-> return c + current_rank().rank" in after(transcript, "(Pdb trainers 1) next")
    assert "trainers 1 goes on" in transcript  # stepping off the end of the endpoint
    assert "trainers 0 (goes on)" in after(transcript, "meshvisor_dbg> continue")
    assert "no call is paused" in after(transcript, "meshvisor_dbg> list")
    assert sorted(results.get(timeout=CALL_TIMEOUT_S).values()) == [41, 42]


@pytest.mark.timeout(180)
def test_only_the_call_that_hit_the_breakpoint_waits(steppers: Any) -> None:
    paused_call = steppers.slice(gpus=0).step.call_one(1)
    (call,) = wait_paused(1)
    assert call.rank == 0
    other_rank = steppers.slice(gpus=1).ping.call_one()
    assert other_rank.get(timeout=CALL_TIMEOUT_S) == 0  # its rank within the slice
    with DebugClient() as client:
        (call,) = client.paused()
        assert "-> return b" in client.send(call, "next").text
        assert "--Return--" in client.send(call, "next").text
        assert client.send(call, "next").resumed  # off the end of the endpoint: it goes on
        assert client.paused() == []
    assert paused_call.get(timeout=CALL_TIMEOUT_S) == 10


@pytest.mark.timeout(180)
def test_a_call_nobody_waits_for_stays_debuggable(steppers: Any) -> None:
    steppers.step.broadcast(1)  # no caller to answer: the pause is still served
    assert sorted(c.rank for c in wait_paused(2)) == [0, 1]
    assert dialogue("continue\n").count("(goes on)") == 2
    assert sorted(steppers.ping.call().get(timeout=CALL_TIMEOUT_S).values()) == [0, 1]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("name", "expected"), [("step", [30, 31]), ("step_async", [61, 62])])
def test_a_paused_rank_is_not_declared_hung(
    make_procs: Callable[..., Any], name: str, expected: list[int]
) -> None:
    with configured(heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0):
        steppers = make_procs({"gpus": 2}).spawn("trainers", Stepper)
    results = getattr(steppers, name).call(3)
    wait_paused(2)
    # A hung proc would be killed and the call would raise SupervisionError; paused, it waits
    # three heartbeat timeouts (and more, but that would only make the test slower).
    with pytest.raises(TimeoutError):
        results.get(timeout=6.0)
    assert "goes on" in dialogue("continue\n")
    assert sorted(results.get(timeout=CALL_TIMEOUT_S).values()) == expected


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("name", "expected"), [("step", [30, 31]), ("step_async", [61, 62])])
def test_a_paused_call_is_not_judged_by_the_call_watchdog(
    make_procs: Callable[..., Any], name: str, expected: list[int]
) -> None:
    with configured(call_limit_s=1.0):
        steppers = make_procs({"gpus": 2}).spawn("limited", Stepper)
    results = getattr(steppers, name).call(3)
    wait_paused(2)
    # Past its 1 s limit a stuck call would fail with SupervisionError; paused, it waits.
    with pytest.raises(TimeoutError):
        results.get(timeout=4.0)
    assert "goes on" in dialogue("continue\n")
    assert sorted(results.get(timeout=CALL_TIMEOUT_S).values()) == expected


@pytest.mark.timeout(120)
@pytest.mark.parametrize("off", [{"MESHVISOR_DEBUG": "0"}, {"PYTHONBREAKPOINT": "0"}])
def test_breakpoints_are_ignored_when_debugging_is_off(
    make_procs: Callable[..., Any], off: dict[str, str]
) -> None:
    steppers = make_procs({"gpus": 2}, env=off).spawn("quiet", Stepper)
    assert sorted(steppers.step.call(5).get(timeout=CALL_TIMEOUT_S).values()) == [50, 51]
    assert sorted(steppers.step_async.call(1).get(timeout=CALL_TIMEOUT_S).values()) == [21, 22]


@pytest.mark.timeout(240)
def test_ranks_on_a_persistent_allocation_are_debugged_over_authenticated_tcp(
    allocation: tuple[Path, list[int]],  # noqa: F811
) -> None:
    alloc, _ = allocation
    procs = attach(str(alloc)).spawn_procs(per_host={"gpus": 1})
    try:
        steppers = procs.spawn("remote", Stepper)
        results = steppers.step.call(6)
        with DebugClient(agents=alloc.read_text().split()) as client:
            assert client.address.startswith("tcp://")
            wait_until(lambda: len(client.paused()) == 2, PAUSE_TIMEOUT_S, "both hosts paused")
        transcript = dialogue_on(str(alloc), "list\ncast remote all p a\ncontinue\n")
        assert after(transcript, "meshvisor_dbg> cast remote all p a").count("60") == 2
        assert "remote 1 (goes on)" in after(transcript, "meshvisor_dbg> continue")
        assert sorted(results.get(timeout=CALL_TIMEOUT_S).values()) == [60, 61]
    finally:
        procs.stop().get(timeout=CALL_TIMEOUT_S)


def dialogue_on(allocation_name: str, script: str) -> str:
    out = io.StringIO()
    debug(allocation=allocation_name, stdin=io.StringIO(script), stdout=out)
    return out.getvalue()


DEBUG_MESSAGES = st.sampled_from(
    [
        debug_wire.ListProcs,
        debug_wire.DebugQuery,
        debug_wire.DebugInput,
        debug_wire.DebugSessions,
        debug_wire.DebugOutput,
    ]
).flatmap(instances)


@pytest.mark.timeout(180)
def test_malformed_debugger_messages_never_disturb_a_paused_call(
    make_procs: Callable[..., Any],
) -> None:
    procs = make_procs({"gpus": 1})
    results = procs.spawn("trainers", Stepper).step.call_one(3)
    (paused,) = wait_paused(1)
    # another actor of the same proc answers while the Stepper is paused
    proc = procs.spawn("exposed", Exposed).address.call_one().get(timeout=CALL_TIMEOUT_S)

    @settings(max_examples=150, deadline=None, database=None)
    @given(DEBUG_MESSAGES, st.booleans())
    def send_one(message: Any, to_agent: bool) -> None:
        if type(message) is debug_wire.DebugInput and message.session == paused.session:
            return  # a well-formed command for the paused call is the user's, not noise
        (agent_peer if to_agent else proc_peer).send(encode(message))

    with raw_peer(proc) as proc_peer, raw_peer(local_agent().address) as agent_peer:
        send_one()
    with DebugClient() as client:
        (call,) = client.paused()
        assert call.session == paused.session
        assert client.send(call, "p a").text.strip() == "30"
        assert client.send(call, "continue").resumed
    assert results.get(timeout=CALL_TIMEOUT_S) == 30


# -- meshvisor debug, in another terminal ------------------------------------------------------


class Terminal:
    """A tmux session on a private server socket: type lines, read the screen."""

    def __init__(self, socket: Path, command: str) -> None:
        self._tmux = ["tmux", "-S", str(socket)]
        self._run("new-session", "-d", "-x", "200", "-y", "50", command)

    def _run(self, *args: str) -> str:
        done = subprocess.run([*self._tmux, *args], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, f"tmux {args[0]} failed: {done.stderr}"
        return done.stdout

    def type(self, line: str) -> None:
        self._run("send-keys", "-l", line)
        self._run("send-keys", "Enter")

    def screen(self) -> str:
        return self._run("capture-pane", "-p", "-S", "-200")

    def wait_for_line(self, line: str) -> None:
        """Wait until a whole line of the screen reads `line` (a value pdb printed)."""
        wait_until(
            lambda: line in [shown.strip() for shown in self.screen().splitlines()],
            PAUSE_TIMEOUT_S,
            f"a line {line!r}",
        )

    def wait_for(self, text: str, count: int = 1) -> str:
        wait_until(lambda: self.screen().count(text) >= count, PAUSE_TIMEOUT_S, repr(text))
        return self.screen()

    def kill(self) -> None:
        subprocess.run([*self._tmux, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Callable[[str], Terminal]]:
    """Opens ``meshvisor debug``-like commands in tmux; its server is killed after the test."""
    opened: list[Terminal] = []
    socket = Path(os.environ["XDG_RUNTIME_DIR"]) / f"tmux-{os.getpid()}-{time.monotonic_ns()}"

    def open_terminal(command: str) -> Terminal:
        opened.append(Terminal(socket, command))
        return opened[-1]

    yield open_terminal
    for term in opened:
        term.kill()
    socket.unlink(missing_ok=True)
    # a front end that is killed (SIGHUP from tmux) still removes its private directory
    base = Path(os.environ["XDG_RUNTIME_DIR"])
    wait_until(lambda: not list(base.glob("meshvisor-debug-*")), 30, "the front end's clean-up")


def debug_command() -> str:
    env = {"XDG_RUNTIME_DIR": os.environ["XDG_RUNTIME_DIR"], "PYTHONPATH": str(ROOT)}
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    # the shell stays when the debugger exits, so that the test can read its last screen
    return f"env {assignments} {shlex.quote(sys.executable)} -m meshvisor debug; exec cat"


@pytest.mark.timeout(240)
def test_meshvisor_debug_in_another_terminal(
    steppers: Any, terminal: Callable[[str], Terminal]
) -> None:
    results: Future[Any] = steppers.step.call(7)
    wait_paused(2)
    term = terminal(debug_command())
    term.wait_for("meshvisor_dbg>")
    term.type("list")
    screen = term.wait_for("in step", 2)
    assert "trainers" in screen and "{gpus=0}" in screen and "{gpus=1}" in screen
    term.type("attach trainers 1")
    term.wait_for("(Pdb trainers 1)")
    term.type("p a * 2")
    term.wait_for_line("140")
    term.type("continue")
    term.wait_for("trainers 1 goes on")
    term.type("cast trainers all p a")
    term.wait_for("--- trainers 0 ---")
    term.type("quit")
    term.wait_for("meshvisor_dbg> quit")
    # the front end is gone: rank 0 stays paused, for the next one
    (left,) = wait_paused(1)
    assert left.rank == 0
    assert "goes on" in dialogue("continue\n")
    assert sorted(results.get(timeout=CALL_TIMEOUT_S).values()) == [70, 71]


@pytest.mark.timeout(240)
def test_a_front_end_killed_while_attached_leaves_the_rank_paused(
    steppers: Any, terminal: Callable[[str], Terminal]
) -> None:
    results = steppers.slice(gpus=0).step.call_one(2)
    wait_paused(1)
    term = terminal(debug_command())
    term.wait_for("meshvisor_dbg>")
    term.type("attach trainers 0")
    term.wait_for("(Pdb trainers 0)")
    term.type("p a + 1000")
    term.wait_for_line("1020")
    term.kill()  # the terminal goes away while attached
    (call,) = wait_paused(1)
    transcript = dialogue("attach trainers 0\np a + 1\ncontinue\n")
    assert "-> b = a + current_rank().rank" in after(transcript, "meshvisor_dbg> attach trainers 0")
    assert after(transcript, "(Pdb trainers 0) p a + 1").strip() == "21"
    assert results.get(timeout=CALL_TIMEOUT_S) == 20
    assert call.rank == 0


def test_meshvisor_debug_refuses_what_is_not_an_agent() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshvisor", "debug", "--agent", "agent-7"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2
    assert "'agent-7' is not a host agent's address (ipc://PATH or tcp://HOST:PORT)" in done.stderr


# -- the prompt's own input --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("attach trainers", "usage: attach ACTOR RANK"),
        ("attach trainers x", "usage: attach ACTOR RANK"),
        ("cast trainers ranks(0:) p a", "is not a rank"),
        ("cast trainers p a", "usage: cast ACTOR ranks(0,1) COMMAND"),
        ("cast trainers ranks(0:4:0) p a", "is not a rank"),
        ("bogus", "unknown command 'bogus'"),
        ("attach nobody 3", "no paused call of 'nobody'"),
        ("list", "no call is paused in the debugger"),
        ("help", "cast ACTOR ranks(0,1) COMMAND"),
    ],
)
def test_the_prompt_explains_bad_commands(line: str, says: str) -> None:
    """Each bad command is explained at the prompt, which goes on."""
    out = io.StringIO()
    debug(agents=[], stdin=io.StringIO(line + "\n"), stdout=out)
    assert says in out.getvalue()


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_no_input_line_breaks_the_prompt(line: str) -> None:
    assume(line.strip() not in ("quit", "q", "exit"))
    out = io.StringIO()
    debug(agents=[], stdin=io.StringIO(line.replace("\n", " ") + "\nquit\n"), stdout=out)
    assert out.getvalue().rstrip().endswith("meshvisor_dbg> quit")
