"""Jobs and launchers: `ProcessJob` (local agent processes), workers started by any launcher
(`run_worker_loop_forever`) and attached to (`attach_to_workers`), and the `JobTrait` interface
that `SlurmJob` shares."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from job import JobState, JobTrait, ProcessJob, SlurmJob
from mesh import Actor, attach_to_workers, endpoint, run_worker_loop_forever
from transport import KEYS_ENV

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent


class Host(Actor):
    @endpoint
    def host_name(self) -> str | None:
        return os.environ.get("MESHVISOR_HOST_NAME")

    @endpoint
    def env(self, name: str) -> str | None:
        return os.environ.get(name)


def first_answers(job: JobTrait) -> dict[str, list[str | None]]:
    """What any job gives: for each named mesh, its hosts' names as its actors see them."""
    with job:
        state = job.state(timeout_s=60)
        assert isinstance(state, JobState)
        answers = {}
        for name in state.nodes:
            procs = state[name].spawn_procs({"procs": 1}, name=f"{name}-procs")
            answers[name] = list(
                procs.spawn("host", Host).host_name.call().get(timeout=30).values()
            )
            procs.stop().get(timeout=30)
        return answers


def live(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def wait_until_gone(pids: list[int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while live(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live(pids), f"still running: {live(pids)}"


# -- ProcessJob ---------------------------------------------------------------------------------


def test_a_process_job_gives_named_host_meshes_of_local_agents() -> None:
    job = ProcessJob({"trainers": 2, "dataloaders": 1})
    assert first_answers(job) == {
        "trainers": ["trainers_0", "trainers_1"],
        "dataloaders": ["dataloaders_0"],
    }


def test_a_process_job_passes_its_environment_and_stops_everything_when_killed() -> None:
    job = ProcessJob({"hosts": 2}, env={"MV_JOB_FLAVOUR": "plum"})
    state = job.state(timeout_s=60)
    try:
        assert state.hosts.sizes == {"hosts": 2}
        procs = state.hosts.spawn_procs({"procs": 2})
        flavours = procs.spawn("host", Host).env.call("MV_JOB_FLAVOUR").get(timeout=30)
        assert list(flavours.values()) == ["plum"] * 4
        agents = list(job.agent_pids.values())
        assert len(live(agents)) == 2
    finally:
        job.kill()
    wait_until_gone(agents, timeout_s=5)
    assert job.agent_pids == {}


def test_a_process_job_whose_agents_cannot_start_says_why() -> None:
    job = ProcessJob({"hosts": 1}, agent_args=["--no-such-option"])
    with pytest.raises(RuntimeError, match=r"(?s)hosts_0 exited.*no-such-option"):
        job.state(timeout_s=30)
    job.kill()


@pytest.mark.parametrize(
    ("meshes", "problem"),
    [({}, "at least one mesh"), ({"a b": 1}, "identifier"), ({"hosts": 0}, "positive")],
)
def test_a_process_job_checks_its_meshes(meshes: dict[str, int], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        ProcessJob(meshes)


def test_the_agents_of_a_process_job_stop_when_its_client_is_killed(tmp_path: Path) -> None:
    client = tmp_path / "client.py"
    client.write_text(
        textwrap.dedent(
            """
            import time
            from job import ProcessJob
            job = ProcessJob({"hosts": 2})
            state = job.state(timeout_s=60)
            state.hosts.spawn_procs({"procs": 1})
            print(*job.agent_pids.values(), flush=True)
            time.sleep(600)
            """
        )
    )
    # The killed client's own run directory stays for the next client to sweep: give it a
    # private base, short enough for socket paths (a longer one would send it to /tmp).
    base = Path(tempfile.mkdtemp(prefix="pj", dir=os.environ["XDG_RUNTIME_DIR"]))
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_RUNTIME_DIR": str(base)}
    try:
        with subprocess.Popen(
            [sys.executable, str(client)], stdout=subprocess.PIPE, env=env, text=True
        ) as process:
            try:
                assert process.stdout is not None
                agents = [int(pid) for pid in process.stdout.readline().split()]
                assert len(live(agents)) == 2, agents
                process.send_signal(signal.SIGKILL)
            finally:
                process.kill()
        wait_until_gone(agents)
        left = [
            (path, sorted(p.name for p in path.iterdir()))
            for path in base.glob("meshvisor-hosts_*")
        ]
        assert not left, f"the agents left their directories: {left}"
        assert list(base.glob("meshvisor-*/owner.pid")), "the client's run dir went elsewhere"
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- bring your own launcher -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def launch_worker(
    address: str, log: Path, *, then: str | None = None, **env: str
) -> subprocess.Popen[bytes]:
    """What any launcher does on a host: run a program that becomes the host's worker (and,
    with `then`, goes on with that code once its mesh shut it down)."""
    code = (
        "from mesh import run_worker_loop_forever; "
        f"run_worker_loop_forever(address={address!r}, ca='trust_all_connections')"
    )
    if then is not None:
        code = (
            "from mesh import run_worker_loop_until_shutdown; "
            f"run_worker_loop_until_shutdown(address={address!r}); {then}"
        )
    with open(log, "wb") as output:
        return subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONPATH": str(REPO), **env},
            stdout=output,
            stderr=subprocess.STDOUT,
        )


def test_workers_started_by_a_launcher_are_attached_to_and_shut_down(tmp_path: Path) -> None:
    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    workers = [
        launch_worker(address, tmp_path / f"w{i}.log", MESHVISOR_HOST_NAME=f"box{i}")
        for i, address in enumerate(addresses)
    ]
    try:
        hosts = attach_to_workers(workers=addresses, ca="trust_all_connections")
        hosts.wait_for_agents(timeout_s=60)
        assert hosts.sizes == {"hosts": 2}
        procs = hosts.spawn_procs({"procs": 1})
        assert list(procs.spawn("host", Host).host_name.call().get(timeout=30).values()) == [
            "box0",
            "box1",
        ]
        hosts.shutdown().get(timeout=30)
        assert [worker.wait(30) for worker in workers] == [0, 0]
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()


def test_a_worker_without_keys_refuses_to_listen_on_tcp(tmp_path: Path) -> None:
    env = {name: value for name, value in os.environ.items() if name != KEYS_ENV}
    worker = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mesh import run_worker_loop_forever; "
            "run_worker_loop_forever(address='tcp://127.0.0.1:0')",
        ],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert worker.returncode != 0
    assert "without authentication" in worker.stderr


def test_a_worker_run_until_shutdown_goes_on_afterwards(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    after = tmp_path / "after"
    worker = launch_worker(address, tmp_path / "w.log", then=f"open({str(after)!r}, 'w')")
    try:
        hosts = attach_to_workers(workers=[address])
        hosts.initialized.get(timeout=60)
        hosts.shutdown().get(timeout=30)
        assert worker.wait(30) == 0
        assert after.exists(), (tmp_path / "w.log").read_text()
    finally:
        worker.kill()
        worker.wait()


def test_a_worker_address_can_come_as_a_future(tmp_path: Path, make_procs: Any) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    worker = launch_worker(address, tmp_path / "w.log")
    try:
        teller = make_procs({"gpus": 1}, env={"MV_WORKER_ADDRESS": address}).spawn("host", Host)
        told = teller.env.call_one("MV_WORKER_ADDRESS")
        hosts = attach_to_workers(workers=[told])
        hosts.wait_for_agents(timeout_s=60)
        hosts.shutdown().get(timeout=30)
        assert worker.wait(30) == 0
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"workers": ["tcp://127.0.0.1:1"], "ca": "/etc/ca.pem"}, ValueError, "CURVE keys"),
        ({"workers": ["tcp://127.0.0.1:1"], "private_key": b"k"}, ValueError, "not TLS"),
        ({"workers": "tcp://127.0.0.1:1"}, TypeError, "list of addresses"),
        ({"workers": []}, ValueError, "at least one"),
        ({"workers": ["http://x"]}, ValueError, "not an agent address"),
        ({"workers": [7]}, TypeError, "must be a string"),
    ],
)
def test_attach_to_workers_rejects_bad_arguments(
    arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        attach_to_workers(**arguments)


def test_run_worker_loop_forever_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="must be tcp://HOST:PORT or ipc://PATH"):
        run_worker_loop_forever(address="localhost:7000")
    with pytest.raises(ValueError, match="not TLS"):
        run_worker_loop_forever(address="tcp://127.0.0.1:0", ca="/etc/ca.pem")


# -- one interface ------------------------------------------------------------------------------


def test_a_slurm_job_answers_through_the_same_job_interface(slurm: Any) -> None:
    job = SlurmJob({"trainers": 2}, name="job-interface", job_dir=slurm.jobs, progress=None)
    assert first_answers(job) == {"trainers": ["n1", "n2"]}
    assert job.slurm_state() not in ("RUNNING", "PENDING")


def test_a_host_mesh_is_initialized_once_its_workers_answer(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    hosts = attach_to_workers(workers=[address])  # nothing listens there yet
    initialized = hosts.initialized
    with pytest.raises(TimeoutError):
        initialized.get(timeout=0.5)
    worker = launch_worker(address, tmp_path / "w.log")
    try:
        assert initialized.get(timeout=60) is True
        hosts.shutdown().get(timeout=30)
        assert worker.wait(30) == 0
    finally:
        worker.kill()
        worker.wait()


# -- the job cache ------------------------------------------------------------------------------


def test_a_cached_persistent_job_is_reused_by_the_next_run_while_it_runs(
    slurm: Any, tmp_path: Path
) -> None:
    cache = tmp_path / "cache" / "job.json"

    def run(meshes: dict[str, int]) -> SlurmJob:
        job = SlurmJob(meshes, name="cached", persistent=True, job_dir=slurm.jobs, progress=None)
        job.state(timeout_s=60, cached_path=cache)
        return job

    first = run({"trainers": 1})
    try:
        assert cache.stat().st_mode & 0o777 == 0o600
        second = run({"trainers": 1})  # as a later run of the same script would
        assert second.job_id == first.job_id
        other = run({"trainers": 2})  # another request: a new job, cached instead
        assert other.job_id != first.job_id
        other.cancel()
        again = run({"trainers": 2})  # the cached job ended: a new one
        assert again.job_id not in (first.job_id, other.job_id)
        again.cancel()
    finally:
        first.cancel()


def test_the_job_cache_refuses_what_it_cannot_honour(slurm: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"persistent=True"):
        SlurmJob({"a": 1}, job_dir=slurm.jobs, progress=None).state(cached_path=tmp_path / "c")
    with pytest.raises(ValueError, match=r"cannot be cached"):
        ProcessJob({"a": 1}).state(cached_path=tmp_path / "c")
    broken = tmp_path / "broken.json"
    broken.write_text("not json")
    job = SlurmJob({"a": 1}, persistent=True, job_dir=slurm.jobs, progress=None)
    with pytest.raises(ValueError, match=r"broken.json is not a meshvisor job cache"):
        job.state(cached_path=broken)
    assert job.job_id is None  # nothing was submitted
