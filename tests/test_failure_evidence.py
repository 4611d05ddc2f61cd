"""Why a proc failed, with evidence: the stacks of a hung proc, a segfault's Python stack, and
out-of-memory deaths (over `memory_limit`, or killed by the kernel's OOM killer in a memory
cgroup), all against real procs, real signals and real allocations.

Every failure is taken by a recording ``on_failure`` handler (the root is guarded as in
test_supervision.py).
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import failing_actors as fa
import hypothesis.strategies as st
import pytest
from hypothesis import given, settings
from polling import wait_gone, wait_until
from recording import Recorder

from mesh import ActorMesh
from supervision import SupervisionError, SupervisionEvent

pytestmark = [pytest.mark.usefixtures("no_failure_reaches_the_root"), pytest.mark.timeout(120)]
T = 30.0  # the bound on every wait (never reached when things work)
FAST_HB = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0}


def spawn_fragile(
    make_procs: Callable[..., Any], **spawn: Any
) -> tuple[ActorMesh[Any], Recorder, int]:
    """One proc with a recording handler and a `Fragile` actor; and the proc's pid."""
    procs = make_procs({"gpus": 1}, **spawn)
    recorder = Recorder()
    procs.on_failure(recorder)
    actors = procs.spawn("fragile", fa.Fragile)
    (pid,) = actors.pid.call().get(timeout=T).values()
    return actors, recorder, pid


def failure_of(call: Any) -> SupervisionEvent:
    """The event of the SupervisionError that the in-flight `call` raises."""
    with pytest.raises(SupervisionError) as info:
        call.get(timeout=T)
    return info.value.event


def first_thread(traceback: str) -> str:
    """The first thread's block of a faulthandler dump (after any header)."""
    blocks = traceback.split("\n\n")
    return next(b for b in blocks if "(most recent call first)" in b)


# -- hung procs carry their stacks ------------------------------------------------------------


def test_a_proc_holding_the_gil_is_dumped_before_it_is_killed(
    make_procs: Callable[..., Any],
) -> None:
    """Its heartbeat thread cannot run (a C call holds the GIL), yet faulthandler answers from
    its C signal handler: the event's traceback shows where it is stuck, first."""
    actors, recorder, pid = spawn_fragile(make_procs, **FAST_HB)
    event = failure_of(actors.hold_gil.call(600))
    assert (event.kind, event.pid) == ("hung", pid)
    assert event.traceback is not None, event
    assert "in hold_gil" in first_thread(event.traceback)
    assert "Python stacks were dumped" in event.message
    assert "in hold_gil" in event.report()
    (told,) = recorder.wait(1)
    assert told.traceback == event.traceback
    wait_gone([pid])


def test_a_stopped_proc_is_continued_for_its_dump(
    make_procs: Callable[..., Any], tmp_path: Path
) -> None:
    """SIGSTOPped in a sync endpoint: continued only to dump its stacks, then killed."""
    actors, recorder, pid = spawn_fragile(make_procs, **FAST_HB)
    marker = tmp_path / "napping"
    in_flight = actors.nap.call(str(marker), 600)
    wait_until(marker.exists, T, "the endpoint to start its nap")
    os.kill(pid, signal.SIGSTOP)
    event = failure_of(in_flight)
    assert (event.kind, event.pid) == ("hung", pid)
    assert "is stopped" in event.message and "stacks were dumped" in event.message
    assert event.traceback is not None and "in nap" in first_thread(event.traceback)
    recorder.wait(1)
    wait_gone([pid])


def test_a_proc_that_cannot_dump_is_killed_and_the_event_says_so(
    make_procs: Callable[..., Any],
) -> None:
    """A proc that does not answer the dump signal (SIGRTMIN+8: here it ignores it; in life a
    tracer holds it) is SIGKILLed after a bounded wait, and the event says no stack was read."""
    actors, recorder, pid = spawn_fragile(make_procs, **FAST_HB)
    actors.ignore_signal.call_one(signal.SIGRTMIN + 8).get(timeout=T)
    event = failure_of(actors.hold_gil.call(600))
    assert (event.kind, event.pid) == ("hung", pid)
    assert "no Python stack could be read: it did not answer the dump signal" in event.message
    assert "SIGKILL" in event.message and event.traceback is None
    recorder.wait(1)
    wait_gone([pid])


# -- segfaults carry the Python stack of the fault ------------------------------------------


def test_a_segfault_carries_the_faulting_python_stack(make_procs: Callable[..., Any]) -> None:
    actors, recorder, pid = spawn_fragile(make_procs)
    event = failure_of(actors.segfault.call())
    assert (event.kind, event.signal, event.pid) == ("signal", "SIGSEGV", pid)
    assert event.traceback is not None
    assert event.traceback.startswith("Fatal Python error: Segmentation fault")
    assert "in segfault" in first_thread(event.traceback)
    recorder.wait(1)


@pytest.mark.parametrize("signame", ["SIGABRT", "SIGBUS", "SIGFPE", "SIGILL"])
def test_other_fatal_signals_carry_the_stack_too(
    make_procs: Callable[..., Any], signame: str
) -> None:
    actors, recorder, _ = spawn_fragile(make_procs)
    event = failure_of(actors.fault.call(signame))
    assert (event.kind, event.signal) == ("signal", signame)
    assert event.traceback is not None and "in fault" in first_thread(event.traceback)
    recorder.wait(1)


def test_a_real_time_signal_is_named_and_the_agent_lives_on(
    make_procs: Callable[..., Any],
) -> None:
    """A proc killed by a signal without a name in Python (SIGRTMIN+3) is reported with one,
    and its agent goes on serving."""
    actors, recorder, pid = spawn_fragile(make_procs)
    in_flight = actors.sleep.call(600)
    os.kill(pid, signal.SIGRTMIN + 3)
    event = failure_of(in_flight)
    assert (event.kind, event.signal, event.pid) == ("signal", "SIGRTMIN+3", pid)
    recorder.wait(1)
    others, _, _ = spawn_fragile(make_procs)
    assert others.ping.call_one().get(timeout=T) == 0


# -- out of memory ---------------------------------------------------------------------------


@pytest.fixture
def memory_cgroup() -> Iterator[Callable[[int], str]]:
    """Factory: a new memory cgroup with a limit (bytes), under this process's own (cgroup v2
    with the memory controller delegated, or v1); removed after the test. Skips the test,
    saying why, where the machine does not let this process make one."""
    made: list[str] = []

    def make(limit: int) -> str:
        path = _new_memory_cgroup(limit)
        made.append(path)
        return path

    yield make
    for path in made:
        wait_until(functools.partial(_removed, path), T, f"cgroup {path} to empty")


def _new_memory_cgroup(limit: int) -> str:
    with open("/proc/self/cgroup") as file:
        lines = [line.rstrip("\n").split(":", 2) for line in file]
    v1 = next((path for _, names, path in lines if "memory" in names.split(",")), None)
    v2 = next((path for _, names, path in lines if names == ""), None)
    name = f"mvt-{secrets.token_hex(4)}"
    if v1 is not None and os.path.isdir("/sys/fs/cgroup/memory"):
        parent = os.path.join("/sys/fs/cgroup/memory", v1.lstrip("/"))
        limits = {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit}
    elif v2 is not None and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        parent = os.path.join("/sys/fs/cgroup", v2.lstrip("/"))
        limits = {"memory.max": limit, "memory.swap.max": 0}
        if "memory" not in _read(os.path.join(parent, "cgroup.subtree_control")).split():
            pytest.skip(f"the memory controller is not delegated to cgroup {parent}")
    else:
        pytest.skip("no cgroup v1 memory hierarchy or cgroup v2 is mounted at /sys/fs/cgroup")
    path = os.path.join(parent, name)
    try:
        os.mkdir(path)
    except OSError as error:
        pytest.skip(
            f"cannot create a memory cgroup under {parent} (needs root or a delegated "
            f"cgroup): {error}"
        )
    for file, value in limits.items():
        if os.path.exists(os.path.join(path, file)):
            with open(os.path.join(path, file), "w") as limit_file:
                limit_file.write(str(value))
    return path


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return ""


def _removed(path: str) -> bool:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def test_a_proc_over_its_memory_limit_fails_as_oom(make_procs: Callable[..., Any]) -> None:
    """memory_limit works without cgroups (RLIMIT_DATA): the allocation that fails kills the
    proc, and the event says out of memory, with the limit and where it allocated."""
    actors, recorder, pid = spawn_fragile(make_procs, memory_limit="256MiB")
    assert actors.allocate.call_one(16).get(timeout=T) == 0  # under the limit: fine
    event = failure_of(actors.allocate.call(512))
    assert (event.kind, event.pid, event.signal) == ("oom", pid, "SIGKILL")
    assert "ran out of memory" in str(event)
    assert "memory limit of 256.0 MiB" in event.message and "peak RSS" in event.message
    assert event.traceback is not None and "in allocate" in event.traceback
    assert "MemoryError" in event.traceback
    (told,) = recorder.wait(1)
    assert told.kind == "oom"
    wait_gone([pid])


def test_a_proc_declared_hung_that_then_runs_out_of_memory_fails_as_oom(
    make_procs: Callable[..., Any],
) -> None:
    """The true cause wins: a proc that its agent declared hung (stopped; here it ignores the
    dump signal, so it is only continued) and that then fails an allocation at its memory
    limit before the agent's kill is reported out of memory, and the event says it was also
    declared hung."""
    actors, recorder, pid = spawn_fragile(make_procs, memory_limit="256MiB", **FAST_HB)
    actors.ignore_signal.call_one(signal.SIGRTMIN + 8).get(timeout=T)
    event = failure_of(actors.stop_then_allocate.call(512))
    assert (event.kind, event.pid, event.signal) == ("oom", pid, "SIGKILL"), event
    assert "memory limit of 256.0 MiB" in event.message
    assert "also declared it hung" in event.message and "it is stopped" in event.message
    assert event.traceback is not None and "in stop_then_allocate" in event.traceback
    (told,) = recorder.wait(1)
    assert told.kind == "oom"
    wait_gone([pid])


def test_the_kernel_oom_killer_is_reported_as_such(
    make_procs: Callable[..., Any], memory_cgroup: Callable[[int], str]
) -> None:
    """A proc in a memory cgroup allocates past the cgroup's limit: the kernel's OOM killer
    SIGKILLs it, and the event says so, with the cgroup's limit, not a bare SIGKILL."""
    cgroup = memory_cgroup(128 << 20)
    join = functools.partial(fa.join_cgroup, cgroup)
    actors, recorder, pid = spawn_fragile(make_procs, bootstrap=join)
    event = failure_of(actors.allocate.call(512))
    assert (event.kind, event.pid, event.signal) == ("oom", pid, "SIGKILL"), event
    assert "OOM killer" in event.message and "memory limit of 128.0 MiB" in event.message
    assert cgroup in event.message
    recorder.wait(1)


@pytest.mark.parametrize(("value", "expected"), [(1 << 30, 1 << 30), ("1.5 GB", 3 << 29)])
def test_a_memory_limit_is_bytes_or_a_size(
    make_procs: Callable[..., Any], value: int | str, expected: int
) -> None:
    """The limit, in bytes (units are powers of 1024), is what a proc may allocate on top of
    what it started with: its RLIMIT_DATA is its private memory at start plus the limit."""
    actors, _, _ = spawn_fragile(make_procs, memory_limit=value)
    limit, vm_data = actors.data_limit.call_one().get(timeout=T)
    assert expected < limit <= expected + vm_data


@pytest.mark.parametrize(
    ("value", "error", "says"),
    [
        ("lots", ValueError, "is not a size"),
        (-1, ValueError, "too small"),
        (1000, ValueError, "at least 1 MiB"),
        (2.5, TypeError, "bytes (int) or a size"),
        (True, TypeError, "bytes (int) or a size"),
    ],
)
def test_bad_memory_limits_are_refused_at_spawn(
    make_procs: Callable[..., Any], value: Any, error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=re.escape(says)):
        make_procs({"gpus": 1}, memory_limit=value)


# -- reports read root cause first, in one screen -----------------------------------------


def test_a_report_leads_with_the_root_cause_and_its_most_relevant_stack() -> None:
    dump = _dump(
        [[["worker.py", "step"]], [["threading.py", "wait"]], [["selectors.py", "select"]]]
    )
    leaf = SupervisionEvent("hung", "trainers", {"gpus": 3}, pid=42, host="n1", traceback=dump)
    top = SupervisionEvent("escalated", "owner", message="not handled", cause=leaf)
    lines = top.report().splitlines()
    assert lines[2] == f"Root cause: {leaf}"
    assert lines[3] == "  kind: hung | mesh: trainers | rank: {'gpus': 3} | pid: 42 | host: n1"
    stuck = lines.index('  File "/src/worker.py", line 1 in step')
    assert lines[stuck - 1].startswith("Thread 0x")
    assert "2 other thread(s), innermost frame first:" in lines
    assert "  thread 0x0000000000000003: select (selectors.py:1)" in lines
    assert lines.index("Propagated up the tree:") > stuck


@settings(max_examples=50, deadline=None)
@given(
    frames=st.lists(st.integers(min_value=0, max_value=150), min_size=1, max_size=40),
    max_lines=st.integers(min_value=16, max_value=60),
    fatal=st.booleans(),
)
def test_the_evidence_of_any_dump_fits_and_keeps_the_innermost_frame(
    frames: list[int], max_lines: int, fatal: bool
) -> None:
    """Whatever the dump (threads, frames), a report's evidence fits in `max_lines` and keeps
    the first thread's title and innermost frame."""
    threads = [[[f"f{t}.py", f"func{t}_{i}"] for i in range(n)] for t, n in enumerate(frames)]
    dump = ("Fatal Python error: Segmentation fault\n\n" if fatal else "") + _dump(threads)
    event = SupervisionEvent("signal", "m", signal="SIGSEGV", traceback=dump)
    evidence = event.evidence(max_lines)
    assert len(evidence) <= max_lines
    assert any(line.startswith("Thread 0x0000000000000001") for line in evidence)
    if frames[0]:
        assert '  File "/src/f0.py", line 1 in func0_0' in evidence


def _dump(threads: list[list[list[str]]]) -> str:
    """A faulthandler dump of `threads`, each a list of (file, function) innermost first."""
    blocks = []
    for number, frames in enumerate(threads, 1):
        title = f"Thread 0x{number:016x} (most recent call first):"
        lines = [f'  File "/src/{file}", line 1 in {name}' for file, name in frames]
        blocks.append("\n".join([title, *lines]))
    return "\n\n".join(blocks) + "\n"
