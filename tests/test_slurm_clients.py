"""SLURM jobs across clients (each client a separate python process, tests/scripts/slurm_client.py):
a persistent job outlives its client, however it ends, and later clients attach to it by id and
by name; a non-persistent one is cancelled when its client exits or is SIGKILLed."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from polling import pid_alive, wait_gone, wait_until

from job import SlurmError, SlurmJob

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).parent / "scripts" / "slurm_client.py"
T = 60.0


class Client:
    """One client process; its output lines by tag (``JOB``, ``PIDS``, ``NODES``)."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
        self.process = subprocess.Popen(
            [sys.executable, str(SCRIPT), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: dict[str, Any] = {}
        self._pending = b""  # stdout read but not yet split into lines
        self._stderr = b""  # stderr read so far
        self._closed: set[int] = set()  # pipes at their end

    def read_until(self, tag: str, timeout_s: float = 2 * T) -> Any:
        """Read output lines until one tagged `tag`; after `timeout_s`, the client is killed
        and the test fails with what it wrote to stderr (its stacks, if it was stuck).
        Stderr is read all along: a client whose stderr pipe filled up would hang in a write."""
        assert self.process.stdout is not None and self.process.stderr is not None
        out, err = self.process.stdout.fileno(), self.process.stderr.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._pending:
                raw, self._pending = self._pending.split(b"\n", 1)
                word, _, rest = raw.decode().strip().partition(" ")
                self.lines[word] = json.loads(rest) if rest else True
                if word == tag:
                    return self.lines[word]
            left = deadline - time.monotonic()
            watched = [out, err] if err not in self._closed else [out]
            ready = select.select(watched, [], [], left)[0] if left > 0 else []
            if not ready:
                self.process.send_signal(signal.SIGKILL)
                raise AssertionError(
                    f"no {tag} from the client in {timeout_s:g} s: {self.stderr_so_far()}"
                )
            if err in ready:
                chunk = os.read(err, 65536)
                self._stderr += chunk
                if not chunk:
                    self._closed.add(err)
            if out in ready:
                chunk = os.read(out, 65536)
                if not chunk:
                    raise AssertionError(f"client ended before {tag}: {self.finish()}")
                self._pending += chunk

    def stderr_so_far(self) -> str:
        """What the (killed) client wrote to stderr, without waiting on its descendants."""
        assert self.process.stderr is not None
        os.set_blocking(self.process.stderr.fileno(), False)
        with contextlib.suppress(OSError):
            while chunk := os.read(self.process.stderr.fileno(), 65536):
                self._stderr += chunk
        return self._stderr.decode(errors="replace")

    def finish(self, timeout_s: float = T) -> str:
        """Wait for the client to end; what it wrote to stderr."""
        _, err = self.process.communicate(timeout=timeout_s)
        return self._stderr.decode(errors="replace") + (err or "")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.communicate(timeout=T)


@pytest.fixture
def clients() -> Iterator[list[Client]]:
    """The clients a test starts; any still running afterwards is killed."""
    started: list[Client] = []
    yield started
    for client in started:
        if client.process.poll() is None:
            client.kill()


def start(clients: list[Client], *args: str) -> Client:
    client = Client(*args)
    clients.append(client)
    return client


def say_bye(client: Client) -> None:
    """Let a started client exit normally (it waits for a line on stdin)."""
    assert client.process.stdin is not None
    client.process.stdin.write("bye\n")
    client.process.stdin.flush()
    client.finish()
    assert client.process.returncode == 0


def squeue_state(slurm: Any, job_id: str) -> str:
    return str(slurm.run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False).stdout.strip())


def scontrol_state(slurm: Any, job_id: str) -> str:
    out = slurm.run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
    return out.split("JobState=", 1)[1].split()[0] if "JobState=" in out else "UNKNOWN"


@pytest.mark.parametrize("ending", ["is SIGKILLed", "exits"])
def test_a_persistent_job_outlives_its_client_which_and_later_clients_attach_by_id_and_name(
    slurm: Any, clients: list[Client], ending: str
) -> None:
    first = start(clients, "start", str(slurm.jobs), "kept", "persistent")
    job_id = first.read_until("JOB")
    first_pids = first.read_until("PIDS")
    first.read_until("READY")
    assert all(pid_alive(pid) for pid in first_pids)
    if ending == "exits":
        say_bye(first)
    else:
        first.kill()
    # the agents reap a dead client's procs (it stopped telling them it is alive) ...
    wait_gone(first_pids, timeout=20)
    # ... and the job keeps running, for the next client
    assert squeue_state(slurm, job_id) == "RUNNING"

    by_id = start(clients, "attach", str(slurm.jobs), job_id)
    assert by_id.read_until("JOB") == job_id
    second_pids = by_id.read_until("PIDS")
    assert by_id.read_until("NODES") == first.lines["NODES"]
    assert not set(second_pids) & set(first_pids)
    by_id.finish()
    assert by_id.process.returncode == 0
    wait_gone(second_pids, timeout=20)
    assert squeue_state(slurm, job_id) == "RUNNING"  # a client that attached cancels nothing

    by_name = start(clients, "attach", str(slurm.jobs), "kept")
    assert by_name.read_until("JOB") == job_id
    by_name.read_until("PIDS")
    by_name.finish()
    assert by_name.process.returncode == 0

    SlurmJob.attach("kept", job_dir=slurm.jobs, progress=None).cancel()
    assert squeue_state(slurm, job_id) == ""
    assert scontrol_state(slurm, job_id) in ("CANCELLED", "UNKNOWN")


@pytest.mark.parametrize("ending", ["exits", "is SIGKILLed"])
def test_a_non_persistent_job_is_cancelled_when_its_client(
    slurm: Any, clients: list[Client], ending: str
) -> None:
    client = start(clients, "start", str(slurm.jobs), "transient", "transient")
    job_id = client.read_until("JOB")
    pids = client.read_until("PIDS")
    client.read_until("READY")
    assert squeue_state(slurm, job_id) == "RUNNING"
    if ending == "exits":
        say_bye(client)
        # the client waited for SLURM to finish the job before it exited
        assert squeue_state(slurm, job_id) == ""
    else:
        client.kill()  # only the reaper can cancel it now
        wait_until(lambda: squeue_state(slurm, job_id) == "", T, f"job {job_id} to leave squeue")
    assert scontrol_state(slurm, job_id) in ("CANCELLED", "UNKNOWN")
    wait_gone(pids, timeout=20)
    with pytest.raises(SlurmError, match=r"cannot attach to SLURM job \d+ \(transient\): it ended"):
        SlurmJob.attach(job_id, job_dir=slurm.jobs, progress=None)


def test_attaching_to_a_job_that_ended_or_to_a_name_nobody_used_is_a_clear_error(
    slurm: Any,
) -> None:
    job = SlurmJob({"workers": 1}, name="short", persistent=True, job_dir=slurm.jobs, progress=None)
    job.state(timeout_s=T)
    attached = SlurmJob.attach("short", job_dir=slurm.jobs, progress=None)
    assert attached.job_id == job.job_id and attached.meshes == {"workers": 1}
    job.cancel()
    with pytest.raises(SlurmError) as ended:
        SlurmJob.attach("short", job_dir=slurm.jobs, progress=None)
    message = str(ended.value)
    assert f"cannot attach to SLURM job {job.job_id} (short)" in message
    assert "CANCELLED" in message and str(job.directory) in message
    with pytest.raises(LookupError, match=r"no meshvisor SLURM job has the id or name 'nobody'"):
        SlurmJob.attach("nobody", job_dir=slurm.jobs, progress=None)
    with pytest.raises(LookupError, match=r"short \(\d+\)"):  # names the jobs that are there
        SlurmJob.attach("999999", job_dir=slurm.jobs, progress=None)


def test_a_name_of_several_jobs_attaches_to_the_one_still_running(slurm: Any) -> None:
    older = SlurmJob(
        {"workers": 1}, name="twice", persistent=True, job_dir=slurm.jobs, progress=None
    )
    newer = SlurmJob(
        {"workers": 1}, name="twice", persistent=True, job_dir=slurm.jobs, progress=None
    )
    older.apply()
    newer.apply()
    try:
        assert SlurmJob.attach("twice", job_dir=slurm.jobs, progress=None).job_id == newer.job_id
        newer.cancel()
        assert SlurmJob.attach("twice", job_dir=slurm.jobs, progress=None).job_id == older.job_id
    finally:
        older.cancel()
        newer.cancel()
