"""meshvisor in a real Jupyter kernel (ipykernel, driven by jupyter_client and nbclient).

A real ``meshvisor agent`` daemon (tcp on loopback) plays the persistent allocation, so that
procs outlive the kernel; it is stopped at the end of each test, with every proc on it. The
kernel imports meshvisor from this checkout and keeps its run directory in the suite's base.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from polling import pid_alive, wait_gone, wait_until

pytest.importorskip("ipykernel")
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
from jupyter_client.manager import KernelManager  # noqa: E402

pytestmark = pytest.mark.timeout(300)

T = 60.0
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "notebook.ipynb"

COUNTER = """
import os, sys, time
from mesh import Actor, attach, current_rank, endpoint

class Counter(Actor):
    def __init__(self):
        self.total = 0

    @endpoint
    def add(self, n):
        self.total += n
        print(f"rank {current_rank().rank} total {self.total}", flush=True)
        return os.getpid(), self.total

    @endpoint
    def die(self):
        os._exit(3)

    @endpoint
    def sleep(self, seconds):
        time.sleep(seconds)

    @endpoint
    def say_when(self, path):
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        print("said", flush=True)

hosts = attach(os.environ["MESHVISOR_NOTEBOOK_ALLOCATION"])
"""


@pytest.fixture
def allocation(tmp_path: Path) -> Iterator[Path]:
    """One daemon agent in an allocation file; stopped (with its procs) afterwards."""
    from conftest import RUN_BASE

    folder = Path(RUN_BASE) / f"notebook-{time.monotonic_ns()}"
    (folder / "run").mkdir(mode=0o700, parents=True)
    alloc = folder / "hosts"
    command = [sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"]
    command += ["--rundir", str(folder / "run"), "--allocation", str(alloc)]
    agent = subprocess.Popen([*command, "--owner-timeout", "1"])
    try:
        wait_until(alloc.exists, T, "the agent to join the allocation")
        yield alloc
    finally:
        agent.terminate()
        agent.wait(T)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def kernel_env(allocation: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment of the kernels: this checkout, the suite's keys and run base, the
    allocation; jupyter's own files under `tmp_path`."""
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    checkout = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([checkout, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["MESHVISOR_NOTEBOOK_ALLOCATION"] = str(allocation)
    env["TMPDIR"] = str(tmp_path)  # ipykernel's cell files
    return env


class Kernel:
    """A real ipykernel, one cell at a time; its outputs as (stream or kind, text) pairs."""

    def __init__(self, env: dict[str, str]) -> None:
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(env=env)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=T)

    def send(self, code: str) -> str:
        return str(self.client.execute(textwrap.dedent(code)))

    def outputs(self, msg_id: str, until_idle: bool = True) -> list[tuple[str, str]]:
        """The outputs of cell `msg_id` until the kernel is idle after it."""
        found: list[tuple[str, str]] = []
        deadline = time.monotonic() + T
        while time.monotonic() < deadline:
            try:
                message = self.client.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                found.append((content["name"], content["text"]))
            elif kind == "error":
                found.append(("error", f"{content['ename']}: {content['evalue']}"))
            elif kind == "status" and content["execution_state"] == "idle" and until_idle:
                return found
        raise AssertionError(f"cell {msg_id} did not finish within {T} s: {found}")

    def run(self, code: str) -> list[tuple[str, str]]:
        return self.outputs(self.send(code))

    def wait_for_output(self, text: str) -> str:
        """Wait until the kernel shows `text`; the id of the cell it shows under."""
        deadline = time.monotonic() + T
        while time.monotonic() < deadline:
            try:
                message = self.client.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if message["msg_type"] == "stream" and text in message["content"]["text"]:
                return str(message["parent_header"].get("msg_id"))
        raise AssertionError(f"the kernel did not show {text!r} within {T} s")

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=False)


@pytest.fixture
def kernel(kernel_env: dict[str, str]) -> Iterator[Kernel]:
    running = Kernel(kernel_env)
    try:
        yield running
    finally:
        running.close()


def _errors(outputs: list[tuple[str, str]]) -> list[str]:
    return [text for kind, text in outputs if kind == "error"]


def _stdout(outputs: list[tuple[str, str]]) -> str:
    return "".join(text for kind, text in outputs if kind == "stdout")


def _spawn(kernel: Kernel, detached: bool = False) -> list[int]:
    """Spawn 2 counters in the kernel; their pids."""
    outputs = kernel.run(
        COUNTER
        + f"""
procs = hosts.spawn_procs(per_host={{"gpus": 2}}, name="nb", detached={detached})
counters = procs.spawn("counters", Counter)
pids = sorted(p for p, _ in counters.add.call(1).get(timeout=60).values())
sys.stdout.write(" ".join(["PIDS", *map(str, pids)]) + "\\n")  # one write: no proc line inside
"""
    )
    assert not _errors(outputs), outputs
    line = next(line for line in _stdout(outputs).splitlines() if line.startswith("PIDS"))
    return [int(pid) for pid in line.split()[1:]]


def test_the_example_notebook_runs_top_to_bottom(kernel_env: dict[str, str]) -> None:
    notebook = nbformat.read(EXAMPLE, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")
    client = nbclient.NotebookClient(notebook, timeout=int(T), kernel_name="python3")
    client.execute(env=kernel_env)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    errors = [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert not errors, errors
    by_start = {
        cell.source.splitlines()[0]: "".join(o.get("text", "") for o in cell.outputs)
        for cell in code
    }
    assert by_start["hosts = attach(ALLOCATION)"].startswith("pids: [")
    added = by_start["totals = counters.add.call(5).get(timeout=60)"]
    assert "totals: [5, 5]" in added
    # what the procs printed shows under the cell that called them, with their rank
    assert "rank 0: total is now 5" in added
    assert "rank 1: total is now 5" in added
    assert "an ActorError that is also a ZeroDivisionError: True" in by_start["try:"]
    assert by_start["procs.stop().get(timeout=60)"] == "stopped\n"


def test_proc_lines_show_under_the_cell_that_called_their_mesh(
    kernel: Kernel, tmp_path: Path
) -> None:
    _spawn(kernel)
    go, done = tmp_path / "go", tmp_path / "done"
    caller = kernel.send(f"counters.slice(gpus=0).say_when.broadcast({str(go)!r})")
    assert not _errors(kernel.outputs(caller))
    # another cell runs when the line arrives: the line still goes under the caller's
    running = kernel.send(
        f"""
        import pathlib
        pathlib.Path({str(go)!r}).touch()
        deadline = time.monotonic() + 60
        while not pathlib.Path({str(done)!r}).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        """
    )
    try:
        assert kernel.wait_for_output("said") == caller
    finally:
        done.touch()
    assert not _errors(kernel.outputs(running))


def test_a_dead_rank_raises_in_its_cell_and_the_kernel_lives_on(kernel: Kernel) -> None:
    pids = _spawn(kernel)
    outputs = kernel.run("counters.slice(gpus=1).die.call_one().get(timeout=60)")
    assert any(
        e.startswith("SupervisionError: ") and "exited with code 3" in e for e in _errors(outputs)
    ), outputs
    outputs = kernel.run("value = counters.slice(gpus=0).add.call_one(2).get(timeout=60)")
    assert not _errors(outputs), outputs
    assert f"({pids[0]}, 3)" in _stdout(kernel.run("sys.stdout.write(f'{value}\\n')"))
    assert kernel.manager.is_alive()


def test_a_rank_dying_while_the_cell_runs_other_code_raises_there(kernel: Kernel) -> None:
    _spawn(kernel)
    outputs = kernel.run(
        "counters.slice(gpus=1).die.broadcast(); time.sleep(60); print('not raised')"
    )
    assert any(e.startswith("SupervisionError: ") for e in _errors(outputs)), outputs
    assert "not raised" not in _stdout(outputs)
    assert not _errors(kernel.run("print('next')"))


def test_an_async_cell_waiting_in_a_supervised_region_gets_the_failure(kernel: Kernel) -> None:
    _spawn(kernel)
    cell = """
        import asyncio
        from mesh import supervised

        async with supervised():
            counters.slice(gpus=1).die.broadcast()
            await asyncio.sleep(60)
        print("not raised")
        """
    outputs = kernel.run(cell)
    assert any(e.startswith("SupervisionError: ") for e in _errors(outputs)), outputs
    assert "not raised" not in _stdout(outputs)
    assert not _errors(kernel.run("print('next')"))


def test_a_rank_dying_between_cells_raises_in_the_next_cell(kernel: Kernel) -> None:
    pids = _spawn(kernel)
    outputs = kernel.run("counters.slice(gpus=1).die.broadcast()")
    assert not _errors(outputs), outputs
    wait_gone([pids[1]], T)
    # the client logs the failure (to the last cell, maybe before it ended: a death is seen
    # in milliseconds); fail-fast must not end the kernel
    if not any("supervision_event" in text for _, text in outputs):
        kernel.wait_for_output("supervision_event")
    assert kernel.manager.is_alive()
    # raised when the next cell starts (or while it runs, at the latest)
    outputs = kernel.run("import time; time.sleep(60); print('not raised')")
    assert any(e.startswith("SupervisionError: ") for e in _errors(outputs)), outputs
    assert "not raised" not in _stdout(outputs)
    outputs = kernel.run("value = counters.slice(gpus=0).add.call_one(1).get(timeout=60)")
    assert not _errors(outputs), outputs
    assert f"({pids[0]}, 2)" in _stdout(kernel.run("sys.stdout.write(f'{value}\\n')"))


def test_the_stop_button_cancels_a_blocking_get_and_the_runtime_goes_on(kernel: Kernel) -> None:
    pids = _spawn(kernel)
    cell = kernel.send(
        "print('waiting', flush=True); counters.slice(gpus=0).sleep.call_one(3600).get()"
    )
    kernel.wait_for_output("waiting")
    kernel.manager.interrupt_kernel()
    outputs = kernel.outputs(cell)
    assert any(e.startswith("KeyboardInterrupt") for e in _errors(outputs)), outputs
    outputs = kernel.run("value = counters.slice(gpus=1).add.call_one(1).get(timeout=60)")
    assert not _errors(outputs), outputs
    assert f"({pids[1]}, 2)" in _stdout(kernel.run("sys.stdout.write(f'{value}\\n')"))
    assert all(pid_alive(pid) for pid in pids)


def test_after_a_kernel_restart_the_detached_mesh_is_adopted_unchanged(kernel: Kernel) -> None:
    pids = _spawn(kernel, detached=True)
    kernel.manager.restart_kernel(now=True)
    kernel.client.wait_for_ready(timeout=T)
    outputs = kernel.run(
        COUNTER
        + """
procs = hosts.adopt_procs("nb")
counters = procs.actor_mesh("counters")
print("ADOPTED", *sorted(counters.add.call(10).get(timeout=60).values()))
procs.flush_logs().get(timeout=60)
"""
    )
    assert not _errors(outputs), outputs
    assert f"ADOPTED ({pids[0]}, 11) ({pids[1]}, 11)" in _stdout(outputs)
    # the adopter gets the procs' lines too, under the cell that called them
    assert "rank 0 total 11" in _stdout(outputs) and "rank 1 total 11" in _stdout(outputs)
    assert not _errors(kernel.run("procs.stop().get(timeout=60)"))
    wait_gone(pids, T)
