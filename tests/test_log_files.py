"""Logs at scale, with real procs: lines aggregated at the client while the per-rank files hold
every one; ``meshvisor logs`` tailing, following and filtering a running and a finished run,
and the rotated files of a persistent agent after its client is gone."""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import RUN_BASE
from polling import wait_until

from mesh import Actor, endpoint
from mesh.testing import LogFileConfig, RankLog

T = 60.0
LOG_HOME = Path(os.environ["MESHVISOR_LOG_DIR"])


class Printer(Actor):
    """Prints lines, as a chatty training loop does."""

    @endpoint
    def say(self, text: str, times: int = 1, to_stderr: bool = False) -> None:
        for _ in range(times):
            print(text, file=sys.stderr if to_stderr else sys.stdout)

    @endpoint
    def count(self, prefix: str, lines: int) -> None:
        for index in range(lines):
            print(f"{prefix} {index}")


def _unique(name: str) -> str:
    return f"{name}{secrets.token_hex(3)}"


def _records_of(mesh: str) -> dict[int, list[dict[str, Any]]]:
    """The records of `mesh`'s procs in the log files of this session's runs, by rank."""
    found: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(LOG_HOME.glob("*/*.log*")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["mesh"] == mesh:
                found.setdefault(record["rank"], []).append(record)
    return found


def _logs(*options: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``meshvisor logs OPTIONS`` to its end."""
    done = subprocess.run(
        [sys.executable, "-m", "meshvisor", "logs", *options],
        capture_output=True,
        text=True,
        timeout=T,
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


class Follow:
    """``meshvisor logs -f OPTIONS`` running; its output lines as they come."""

    def __init__(self, *options: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "meshvisor", "logs", "-f", *options],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        assert self.process.stdout is not None
        threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))

    def wait_for(self, expected: list[str], in_order: bool = True) -> None:
        """Wait until the lines shown so far are `expected` (in this order, if `in_order`)."""

        def shown() -> bool:
            while not self._queue.empty():
                self.lines.append(self._queue.get())
            return len(self.lines) >= len(expected)

        wait_until(shown, T, f"'meshvisor logs -f' to show {expected}")
        assert self.lines == expected if in_order else sorted(self.lines) == sorted(expected)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            assert self.process.wait(T) == 0
        finally:
            self.process.kill()
            self.process.wait()
            for stream in (self.process.stdout, self.process.stderr):
                assert stream is not None
                stream.close()


@pytest.fixture
def follow() -> Iterator[Callable[..., Follow]]:
    started: list[Follow] = []

    def start(*options: str) -> Follow:
        started.append(Follow(*options))
        return started[-1]

    yield start
    for follower in started:
        if follower.process.poll() is None:
            follower.stop()


def test_sixteen_ranks_are_shown_aggregated_and_their_files_hold_every_line(
    make_procs: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    name = _unique("chatty")
    procs = make_procs({"gpus": 16}, name=name)
    printers = procs.spawn("printers", Printer)
    procs.logging_option(aggregate_window_sec=600).get(timeout=T)
    printers.say.call("loss 0.12", times=100).get(timeout=T)
    procs.flush_logs().get(timeout=T)
    shown = [line for line in capsys.readouterr().out.splitlines() if line]
    assert shown == [f"[16 ranks, 1600 times: {name}{{gpus=0..15}}] loss 0.12"]
    records = _records_of(name)
    assert sorted(records) == list(range(16))
    for rank, kept in records.items():
        assert [r["text"] for r in kept] == ["loss 0.12"] * 100
        assert {(r["point"]["gpus"], r["stream"], r["level"]) for r in kept} == {
            (rank, "stdout", "info")
        }


def test_with_streaming_off_the_lines_are_only_in_the_files(
    make_procs: Callable[..., Any], agent_capfd: Callable[[], pytest.CaptureFixture[str]]
) -> None:
    capfd = agent_capfd()  # the agent's own output too: the lines go to neither
    name = _unique("quiet")
    procs = make_procs({"gpus": 2}, name=name)
    printers = procs.spawn("printers", Printer)
    procs.logging_option(stream_to_client=False, aggregate_window_sec=None).get(timeout=T)
    printers.say.call("kept on disk", times=50).get(timeout=T)
    printers.say.call("also on disk", to_stderr=True).get(timeout=T)
    procs.flush_logs().get(timeout=T)
    captured = capfd.readouterr()
    assert "on disk" not in captured.out + captured.err
    records = _records_of(name)
    for rank in range(2):
        texts = [(r["stream"], r["text"]) for r in records[rank]]
        assert texts == [("stdout", "kept on disk")] * 50 + [("stderr", "also on disk")]


def test_logs_follows_and_filters_a_running_run_then_shows_it_finished(
    make_procs: Callable[..., Any], follow: Callable[..., Follow]
) -> None:
    name = _unique("follow")
    procs = make_procs({"gpus": 2}, name=name)
    printers = procs.spawn("printers", Printer)
    printers.say.call("before").get(timeout=T)
    wait_until(lambda: sum(map(len, _records_of(name).values())) == 2, T, "the first lines")
    run_dir = next(LOG_HOME.glob(f"*/{name}-*.log")).parent
    everything = follow("--mesh", name, "--dir", str(run_dir))
    errors_of_one = follow("--mesh", name, "--rank", "gpus=1", "--level", "error")  # newest run
    # the two ranks printed at about the same time: in the order of their records' times
    everything.wait_for([f"[{name} {{'gpus': {g}}}] before" for g in range(2)], in_order=False)

    printers.slice(gpus=0).say.call("fine").get(timeout=T)
    everything.wait_for([*everything.lines, f"[{name} {{'gpus': 0}}] fine"])
    printers.slice(gpus=1).say.call("bad", to_stderr=True).get(timeout=T)
    everything.wait_for([*everything.lines, f"[{name} {{'gpus': 1}}] bad"])
    errors_of_one.wait_for([f"[{name} {{'gpus': 1}}] bad"])
    everything.stop()
    errors_of_one.stop()

    procs.stop().get(timeout=T)
    where = ("--dir", str(run_dir), "--mesh", name)
    assert _logs(*where).stdout.splitlines()[-2:] == [
        f"[{name} {{'gpus': 0}}] fine",
        f"[{name} {{'gpus': 1}}] bad",
    ]
    assert _logs(*where, "-n", "1").stdout.splitlines() == [f"[{name} {{'gpus': 1}}] bad"]
    assert _logs(*where, "--rank", "1", "--since", "1h").stdout.splitlines() == [
        f"[{name} {{'gpus': 1}}] before",
        f"[{name} {{'gpus': 1}}] bad",
    ]
    before = datetime.fromtimestamp(time.time() - 3600).isoformat()
    assert _logs(*where, "--until", before).stdout == ""
    timed = _logs(*where, "--level", "warning", "-t").stdout.splitlines()
    assert len(timed) == 1 and timed[0].endswith(f"error    [{name} {{'gpus': 1}}] bad")
    records = [json.loads(line) for line in _logs(*where, "--json").stdout.splitlines()]
    assert {r["proc"].rsplit("-", 1)[1] for r in records} == {"0", "1"}


def test_logs_explains_what_it_cannot_show(tmp_path: Path) -> None:
    missing = _logs("--dir", str(tmp_path / "nowhere"), check=False)
    assert missing.returncode == 1 and "not found" in missing.stderr
    (tmp_path / "empty").mkdir()
    unknown = _logs("--dir", str(tmp_path / "empty"), "--mesh", "ghost", check=False)
    assert unknown.returncode == 1
    assert "no proc of mesh 'ghost' wrote to" in unknown.stderr
    level = _logs("--dir", str(tmp_path), "--level", "loud", check=False)
    assert level.returncode == 1 and "--level 'loud' is not a level" in level.stderr
    job = _logs("--job", "no-such-job", check=False)
    assert job.returncode == 1 and "no-such-job" in job.stderr


def test_logs_of_a_slurm_job_are_found_by_its_id(tmp_path: Path) -> None:
    """The files a SLURM job's agents write to ``JOBDIR/logs`` (agents run with --log-dir
    there), read by job id: written here by the fork server's own writer."""
    job_dir = tmp_path / "home" / "slurm" / "train-1a2b3c4d"
    (job_dir / "logs").mkdir(parents=True, mode=0o700)
    spec = {"name": "train", "meshes": {"hosts": 2}, "persistent": True, "keys": "", "python": ""}
    (job_dir / "job.json").write_text(json.dumps(spec | {"job_id": "4121"}))
    for rank in range(2):
        proc = {"proc_id": f"trainers-0a0b0c-{rank}", "mesh_name": "trainers", "rank": rank}
        proc |= {"labels": ["hosts"], "sizes": [2]}
        log = RankLog(LogFileConfig(str(job_dir / "logs")), proc, 100 + rank, f"n{rank + 1}")
        log.write(1, [f"hello from n{rank + 1}".encode()])
        log.close()
    env = {**os.environ, "MESHVISOR_HOME": str(tmp_path / "home")}
    shown = subprocess.run(
        [sys.executable, "-m", "meshvisor", "logs", "--job", "4121", "--rank", "hosts=1"],
        capture_output=True,
        text=True,
        timeout=T,
        env=env,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == ["[trainers {'hosts': 1}] hello from n2"]


CLIENT = textwrap.dedent("""
    import logging, sys
    from mesh import Actor, attach, endpoint

    class Chatty(Actor):
        @endpoint
        def chat(self, lines):
            for index in range(lines):
                print(f"line {{index}}")
            logging.getLogger("chatty").error("done")  # no handler: "done" on stderr

    procs = attach({alloc!r}).spawn_procs(per_host={{"gpus": 2}}, name={name!r})
    procs.spawn("chatty", Chatty).chat.call(400).get(timeout=60)
""")


def test_a_persistent_agent_keeps_rotated_logs_after_its_client_is_gone(tmp_path: Path) -> None:
    name = _unique("persist")
    alloc = Path(RUN_BASE) / f"alloc-{name}"
    env = {**os.environ, "MESHVISOR_LOG_FILE_BYTES": "8192", "MESHVISOR_LOG_FILES": "3"}
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"),
            *("--allocation", str(alloc), "--owner-timeout", "1"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: alloc.exists() and alloc.read_text().strip(), T, "the agent to join")
        script = tmp_path / "client.py"
        script.write_text(CLIENT.format(alloc=str(alloc), name=name))
        client = subprocess.run([sys.executable, str(script)], timeout=2 * T, capture_output=True)
        assert client.returncode == 0, client.stderr.decode()

        log_dir = LOG_HOME / f"allocation-{alloc.name}"
        for rank in range(2):
            files = sorted(log_dir.glob(f"{name}-*-{rank}.log*"))
            assert 1 < len(files) <= 3, files  # rotated, at most 3 kept
            assert all(path.stat().st_size <= 8192 for path in files)
        shown = _logs("--allocation", str(alloc), "--mesh", name, "--rank", "1").stdout
        lines = shown.splitlines()
        prefix = f"[{name} {{'hosts': 0, 'gpus': 1}}]"
        first = int(lines[0].rsplit(" ", 1)[1])
        assert first > 0  # the oldest lines were rotated away...
        expected = [f"{prefix} line {i}" for i in range(first, 400)]
        assert lines == [*expected, f"{prefix} done"]  # ...and none is missing after them
        errors = _logs("--allocation", alloc.name, "--level", "error", "-n", "5").stdout
        assert sorted(errors.splitlines()) == [
            f"[{name} {{'hosts': 0, 'gpus': {g}}}] done" for g in range(2)
        ]
    finally:
        agent.terminate()
        agent.wait(T)


def test_an_agent_keeps_the_newest_fifty_run_directories(tmp_path: Path) -> None:
    home = tmp_path / "logs"
    for index in range(55):
        old = home / f"run-20250101-0000{index:02d}-1"
        old.mkdir(parents=True)
        os.utime(old, (1_700_000_000 + index, 1_700_000_000 + index))
    (home / "allocation-big").mkdir()  # an allocation's logs are never swept
    address_file = tmp_path / "address"
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "meshvisor", "agent", "--listen", f"ipc://{tmp_path}/agent"),
            *("--rundir", str(tmp_path), "--address-file", str(address_file)),
            *("--owner-pid", str(os.getpid())),
        ],
        env={**os.environ, "MESHVISOR_LOG_DIR": str(home)},
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(address_file.exists, T, "the agent to listen")
    finally:
        agent.terminate()
        agent.wait(T)
    runs = sorted(path.name for path in home.glob("run-*"))
    assert len(runs) == 50
    assert runs[0] == "run-20250101-000006-1"  # the six oldest went
    assert runs[-1].endswith(f"-{os.getpid()}")  # the agent's own, made private
    assert stat.S_IMODE((home / runs[-1]).stat().st_mode) == 0o700
    assert (home / "allocation-big").is_dir()
