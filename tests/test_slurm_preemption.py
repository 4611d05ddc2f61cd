"""Preemption and time-limit notices: the host agent's notice signal becomes a "preempting"
supervision event for the owners of its procs, a ReplicaGroup drains on it, and a requeued
SLURM job comes back with new agents that `SlurmJob.attach(...).state()` finds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import actors
import pytest
from polling import wait_until
from taps import tapped

from job import SlurmJob
from mesh import Actor, attach, endpoint
from supervision import SupervisionError, SupervisionEvent

pytestmark = pytest.mark.timeout(180)

T = 30.0
AGENT = (sys.executable, "-m", "meshvisor", "agent")


class Recorder:
    """An on_failure handler that records what it hears (from the event loop thread)."""

    def __init__(self, handles: bool = True) -> None:
        self.events: list[SupervisionEvent] = []
        self.handles = handles
        self.lock = threading.Lock()

    def __call__(self, event: SupervisionEvent) -> bool:
        with self.lock:
            self.events.append(event)
        return self.handles

    def kinds(self) -> list[str]:
        with self.lock:
            return [event.kind for event in self.events]


@pytest.fixture
def notice_agent(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A daemon agent with ``--notice-signal USR1`` that says 42 s are left, in its own
    process group (as a SLURM step: the scheduler signals the whole group)."""
    address_file = tmp_path / "address"
    (tmp_path / "run").mkdir(mode=0o700)
    ask = f"{sys.executable} -c print(42)"
    agent = subprocess.Popen(
        [
            *AGENT,
            *("--listen", f"ipc://{tmp_path}/agent", "--rundir", str(tmp_path / "run")),
            *("--address-file", str(address_file), "--notice-signal", "USR1"),
            *("--time-left-command", ask),
        ],
        start_new_session=True,
    )
    try:
        wait_until(address_file.exists, T, "the agent to listen")
        agent.address = address_file.read_text().strip()  # type: ignore[attr-defined]
        yield agent
    finally:
        agent.terminate()
        try:
            agent.wait(T)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait(T)


def test_the_notice_signal_reaches_the_owners_handlers_with_the_time_left(
    notice_agent: Any,
) -> None:
    procs = attach([notice_agent.address]).spawn_procs(per_host={"gpus": 2}, name="doomed")
    try:
        echo = procs.spawn("echo", actors.Echo)
        assert echo.echo.call(1).get(timeout=T)  # up
        heard_by_actors, heard_by_procs = Recorder(), Recorder()
        echo.on_failure(heard_by_actors)
        procs.on_failure(heard_by_procs)
        os.killpg(notice_agent.pid, signal.SIGUSR1)  # procs and fork server get it too
        wait_until(lambda: len(heard_by_actors.kinds()) == 2, T, "a notice per rank")
        events = sorted(heard_by_actors.events, key=lambda e: dict(e.rank or {})["gpus"])
        assert [e.kind for e in events] == ["preempting", "preempting"]
        assert [dict(e.rank or {})["gpus"] for e in events] == [0, 1]
        assert {e.time_left_s for e in events} == {42.0}
        assert all(e.mesh_name == "echo" and e.actor_id for e in events)
        assert "about to be preempted" in str(events[0]) and "42 s left" in str(events[0])
        assert heard_by_procs.events == []  # the actor mesh's handler handled it
        assert sorted(echo.echo.call(2).get(timeout=T).values()) == [2, 2]  # nothing died
    finally:
        procs.stop().get(timeout=T)


def test_an_unhandled_notice_is_printed_and_nothing_fails(notice_agent: Any) -> None:
    procs = attach([notice_agent.address]).spawn_procs(per_host={"gpus": 1}, name="ignored")
    try:
        echo = procs.spawn("echo", actors.Echo)
        assert echo.echo.call_one(1).get(timeout=T) == 1
        with tapped("stderr") as stderr:  # the client's loop thread prints the warning
            os.kill(notice_agent.pid, signal.SIGUSR1)
            wait_until(lambda: "Nothing handles it" in stderr.text(), T, "the warning")
        for value in range(3):  # fail-fast would raise a SupervisionError here
            assert echo.echo.call_one(value).get(timeout=T) == value
    finally:
        procs.stop().get(timeout=T)


def test_a_signal_name_that_names_no_signal_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [*AGENT, "--listen", f"ipc://{tmp_path}/a", "--notice-signal", "USR9"],
        capture_output=True,
        text=True,
        timeout=T,
    )
    assert done.returncode == 2
    assert "--notice-signal: 'USR9' names no signal (e.g. USR1, SIGUSR2 or 10)" in done.stderr


def test_a_notice_while_the_agent_starts_is_kept_not_fatal(tmp_path: Path) -> None:
    """A scheduler may signal a step at once: a notice while the agent still imports (here as
    soon as it imported zmq, long before its watch is installed) must not end it (the signal's
    default action) and is handled once the agent runs."""
    (tmp_path / "run").mkdir(mode=0o700)
    command = [sys.executable, "-X", "importtime", *AGENT[1:]]
    command += ["--listen", f"ipc://{tmp_path}/agent", "--rundir", str(tmp_path / "run")]
    command += ["--notice-signal", "USR1", "--time-left-command", f"{sys.executable} -c print(42)"]
    agent = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        assert agent.stderr is not None
        for line in agent.stderr:
            lines.append(line)
            if line.split("|")[-1].strip() == "zmq":  # the agent's own imports are under way
                os.kill(agent.pid, signal.SIGUSR1)
                break
        reader = threading.Thread(target=lambda: lines.extend(agent.stderr or ()), daemon=True)
        reader.start()
        heard = lambda: any("notice_received" in line for line in lines)  # noqa: E731
        wait_until(lambda: heard() or agent.poll() is not None, T, "the notice")
        assert agent.poll() is None, "the agent died of a notice that came while it started"
        (notice,) = [line for line in lines if "notice_received" in line]
        assert "signal=SIGUSR1" in notice and "time_left_s=42" in notice, notice
    finally:
        agent.terminate()
        agent.wait(T)
        if agent.stderr:
            agent.stderr.close()


class Owner(Actor):
    """Owns a mesh on the agent at `address`; its __supervise__ does not handle notices."""

    def __init__(self, address: str) -> None:
        self.procs = attach([address]).spawn_procs(per_host={"gpus": 1}, name="owned")
        self.child = self.procs.spawn("child", actors.Echo)
        self.heard: list[str] = []

    def __supervise__(self, event: SupervisionEvent) -> bool:
        self.heard.append(event.kind)
        return False  # unhandled: a notice must not fail this actor

    @endpoint
    def heard_kinds(self) -> list[str]:
        return list(self.heard)

    @endpoint
    def child_echo(self, value: int) -> int:
        return int(self.child.echo.call_one(value).get(timeout=T))

    @endpoint
    def stop_child(self) -> None:
        self.procs.stop().get(timeout=T)


def test_an_owning_actor_hears_the_notice_and_lives_on_without_handling_it(
    notice_agent: Any, tmp_path: Path
) -> None:
    from mesh import this_host

    with this_host().spawn_procs(per_host={"gpus": 1}, name="owners") as owners:
        owner = owners.spawn("owner", Owner, notice_agent.address)
        assert owner.child_echo.call_one(5).get(timeout=T) == 5
        os.kill(notice_agent.pid, signal.SIGUSR1)
        wait_until(
            lambda: owner.heard_kinds.call_one().get(timeout=T) == ["preempting"],
            T,
            "the owner's __supervise__ to hear the notice",
        )
        assert owner.child_echo.call_one(6).get(timeout=T) == 6  # neither failed
        owner.stop_child.call_one().get(timeout=T)


# -- with SLURM ------------------------------------------------------------------------------


class Where(Actor):
    @endpoint
    def node(self) -> str | None:
        return os.environ.get("SLURMD_NODENAME")

    @endpoint
    def restart_count(self) -> str | None:
        return os.environ.get("SLURM_RESTART_COUNT")


def test_scancel_signal_gives_a_preempting_event_with_slurms_time_left(slurm: Any) -> None:
    job = SlurmJob({"workers": 2}, name="notice", job_dir=slurm.jobs, time_limit="10:00")
    try:
        state = job.state(timeout_s=60)
        procs = state.workers.spawn_procs({"gpus": 1}, name="workers")
        where = procs.spawn("where", Where)
        assert sorted(where.node.call().get(timeout=T).values()) == ["n1", "n2"]
        heard = Recorder()
        where.on_failure(heard)
        sent = time.monotonic()
        slurm.run(["scancel", "--signal=USR1", str(job.job_id)])
        wait_until(lambda: len(heard.kinds()) == 2, T, "a notice from each node's agent")
        print(f"scancel --signal=USR1 to both handlers: {time.monotonic() - sent:.2f} s")
        assert set(heard.kinds()) == {"preempting"}
        left = [e.time_left_s for e in heard.events]
        assert all(t is not None and 500 < t <= 600 for t in left), left
        assert sorted(where.node.call().get(timeout=T).values()) == ["n1", "n2"]  # all alive
        procs.stop().get(timeout=T)
    finally:
        job.cancel()


def test_a_requeued_job_comes_back_with_new_agents_and_old_procs_fail(slurm: Any) -> None:
    job = SlurmJob({"workers": 1}, name="requeue", job_dir=slurm.jobs, requeue=True)
    try:
        state = job.state(timeout_s=60)
        procs = state.workers.spawn_procs({"gpus": 1}, name="before")
        where = procs.spawn("where", Where)
        assert where.restart_count.call_one().get(timeout=T) in (None, "0")  # first run
        heard = Recorder()
        where.on_failure(heard)
        requeued = time.monotonic()
        slurm.run(["scontrol", "requeue", str(job.job_id)])
        with pytest.raises(SupervisionError):  # its agent is gone with the old run
            wait_until(lambda: where.node.call_one().get(timeout=T) is None, 60, "a failure")
        # SLURM holds a requeued job back for the credential lifetime (120 s by default)
        wait_until(lambda: _pending(job), 60, "the job to be pending again")
        slurm.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"])
        again = SlurmJob.attach(str(job.job_id), job_dir=slurm.jobs).state(timeout_s=90)
        print(f"requeue to the new run's agents: {time.monotonic() - requeued:.2f} s")
        assert again.restarts == 1
        assert job.state(timeout_s=90).restarts == 1  # the old handle notices the restart
        after = again.workers.spawn_procs({"gpus": 1}, name="after")
        fresh = after.spawn("where", Where)
        assert fresh.restart_count.call_one().get(timeout=T) == "1"
        after.stop().get(timeout=T)
        print(f"the old run's proc, as its owner heard: {heard.kinds()}")
        assert heard.kinds() and set(heard.kinds()) <= {"unreachable", "signal", "exit"}
    finally:
        job.cancel()


def _pending(job: SlurmJob) -> bool:
    return job.slurm_state() == "PENDING"


def test_slurms_own_warning_signal_before_the_time_limit_reaches_the_handler(slurm: Any) -> None:
    job = SlurmJob(
        {"workers": 1}, name="limit", job_dir=slurm.jobs, time_limit="1", warning_time_s=50
    )
    try:
        state = job.state(timeout_s=60)
        started = time.monotonic()
        where = state.workers.spawn_procs({"gpus": 1}, name="limited").spawn("where", Where)
        assert where.node.call_one().get(timeout=T) == "n1"
        heard = Recorder()
        where.on_failure(heard)
        wait_until(lambda: "preempting" in heard.kinds(), 75, "SLURM's warning signal")
        event = heard.events[heard.kinds().index("preempting")]
        print(
            f"--signal=USR1@50 with a 1 minute limit came after {time.monotonic() - started:.1f}"
            f" s, time left {event.time_left_s} s"
        )
        assert event.time_left_s is not None and event.time_left_s <= 60
        assert where.node.call_one().get(timeout=T) == "n1"  # the notice killed nothing
    finally:
        job.cancel()


def test_a_replica_group_drains_on_the_notice_and_the_loop_saves_and_exits(slurm: Any) -> None:
    import replica_actors as ra

    from recovery import ReplicaGroup

    job = SlurmJob({"trainers": 2}, name="drain", job_dir=slurm.jobs, time_limit="10:00")
    try:
        state = job.state(timeout_s=60)
        group = ReplicaGroup(state.trainers, ra.Trainer, replicas=2, min_replicas=1)
        try:
            while group.committed_steps < 2:
                group.step()
            notice = threading.Thread(
                target=slurm.run, args=(["scancel", "--signal=USR1", str(job.job_id)],)
            )
            notice.start()  # while the loop steps on: the notice lands during some step
            deadline = time.monotonic() + 60
            while group.preempted is None:  # a user's training loop
                assert time.monotonic() < deadline, "no notice reached the group"
                group.step()
            notice.join(T)
            assert group.preempted.kind == "preempting" and group.preempted.time_left_s
            assert group.check_consistency() is None  # no step was left half done
            assert group.events == [] and group.live() == (0, 1)  # no replica failed
            saved = group.drain()
            assert saved["step"] == group.committed_steps >= 2
            assert set(saved) == {"step", "model", "optimizer"}
        finally:
            group.close()
    finally:
        job.cancel()
