"""Losing a node of a SLURM job (a real private SLURM cluster): the machine dies, an admin sets
it DOWN, or its agent's job step is cancelled. Events name the node within the agent timeout,
the other nodes keep answering, and failed ranks come back on a spare node: by hand, by a
restart policy, and in a `ReplicaGroup` that keeps training.

Node n1 runs the job's batch script (losing it ends the job, as on a real cluster), so the
nodes lost here are others.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import RUN_BASE
from polling import wait_until

from job import JobState, SlurmJob
from job import _local_processes as _processes
from job.testing import agent_step
from mesh import Actor, Settings, attach, endpoint
from supervision import RestartPolicy, SupervisionError, SupervisionEvent

pytestmark = pytest.mark.timeout(240)

T = 60.0
#: The agent timeout (client side): a lost node's procs are unreachable after this silence.
AGENT_TIMEOUT_S = Settings().agent_timeout_s
#: A liveness bound on noticing a lost node (the design: the agent timeout, plus one period).
NOTICE_BOUND_S = 5 * AGENT_TIMEOUT_S


class Node(Actor):
    @endpoint
    def node(self) -> str | None:
        return os.environ.get("SLURMD_NODENAME")

    @endpoint
    def sleep(self, seconds: float) -> str | None:
        time.sleep(seconds)
        return os.environ.get("SLURMD_NODENAME")


@pytest.fixture
def job(slurm: Any) -> Iterator[tuple[SlurmJob, JobState]]:
    """A job of trainers n1..n3 and a spare n4, cancelled afterwards."""
    job = SlurmJob({"trainers": 3, "spare": 1}, name="node-loss", job_dir=slurm.jobs, progress=None)
    try:
        state = job.state(timeout_s=T)
        assert dict(state.nodes) == {"trainers": ("n1", "n2", "n3"), "spare": ("n4",)}
        yield job, state
    finally:
        job.cancel()
        _sweep_run_dirs_of_dead_agents()


def _sweep_run_dirs_of_dead_agents() -> None:
    """What the next meshvisor process would do: remove the run directories of agents SLURM
    killed (SIGKILL leaves them no time to clean up)."""
    for entry in Path(tempfile.gettempdir()).glob("meshvisor-agent-*"):
        try:
            pid = int((entry / "owner.pid").read_text().strip())
        except (OSError, ValueError):
            continue
        if not Path(f"/proc/{pid}").exists():
            shutil.rmtree(entry, ignore_errors=True)


def _nodes(actors: Any) -> list[str | None]:
    return list(actors.node.call().get(timeout=T).values())


def _answer(actors: Any) -> str | None:
    """The node of the one actor of `actors`, or None if the call fails (its proc is lost)."""
    try:
        node: str | None = actors.node.call_one().get(timeout=T)
    except SupervisionError:
        return None
    return node


def _watch(procs: Any) -> list[tuple[float, SupervisionEvent]]:
    """The events of `procs`' failures, with when they came (handled: nothing escalates)."""
    events: list[tuple[float, SupervisionEvent]] = []
    procs.on_failure(lambda event: events.append((time.monotonic(), event)) or True)
    return events


def test_a_killed_node_fails_the_waiting_call_and_tells_the_owner_naming_the_node(
    slurm: Any, job: tuple[SlurmJob, JobState], record_property: Any
) -> None:
    _, state = job
    procs = state.trainers.spawn_procs({"gpus": 1}, name="workers")
    events = _watch(procs)
    actors = procs.spawn("node", Node)
    assert _nodes(actors) == ["n1", "n2", "n3"]
    waiting = actors.slice(hosts=1).sleep.call_one(120)
    time.sleep(0.2)  # not a synchronization: the call is under way on n2 either way
    killed_at = time.monotonic()
    assert slurm.kill_node("n2"), "kill_node found no process of n2's job step"
    with pytest.raises(SupervisionError) as caught:
        waiting.get(timeout=T)
    failed_after = time.monotonic() - killed_at
    wait_until(lambda: bool(events), T, "the owner's handler to hear of n2")
    noticed_after = events[0][0] - killed_at
    record_property("call_failed_after_s", round(failed_after, 2))
    record_property("event_after_s", round(noticed_after, 2))
    print(f"node killed: call failed after {failed_after:.2f} s, event after {noticed_after:.2f} s")
    event = events[0][1]
    assert event.kind == "unreachable" and event.host == "n2", event
    assert "n2" in str(event) and "n2" in str(caught.value), (event, caught.value)
    assert noticed_after < NOTICE_BOUND_S and failed_after < NOTICE_BOUND_S
    assert [e.kind for _, e in events] == ["unreachable"]
    assert actors.slice(hosts=0).node.call_one().get(timeout=T) == "n1"  # the others answer
    assert actors.slice(hosts=2).node.call_one().get(timeout=T) == "n3"


def test_a_node_set_down_loses_its_step_and_the_job_keeps_the_other_nodes(
    slurm: Any, job: tuple[SlurmJob, JobState]
) -> None:
    """SLURM 22.05 kills the job step of a node set DOWN at once; a --no-kill job keeps
    running on its other nodes (the node leaves its node list)."""
    slurm_job, state = job
    procs = state.trainers.spawn_procs({"gpus": 1}, name="workers")
    events = _watch(procs)
    actors = procs.spawn("node", Node)
    assert _nodes(actors) == ["n1", "n2", "n3"]
    down_at = time.monotonic()
    slurm.set_node_down("n3", "meshvisor node-loss test")
    wait_until(lambda: bool(events), T, "the owner's handler to hear of n3")
    print(f"node set down: event after {events[0][0] - down_at:.2f} s")
    assert events[0][1].kind == "unreachable" and events[0][1].host == "n3", events
    assert events[0][0] - down_at < NOTICE_BOUND_S
    assert slurm_job.slurm_state() == "RUNNING"
    shown = slurm.run(["scontrol", "show", "job", str(slurm_job.job_id)]).stdout
    assert " NodeList=n[1-2,4]" in shown, shown
    assert actors.slice(hosts=0).node.call_one().get(timeout=T) == "n1"
    assert actors.slice(hosts=1).node.call_one().get(timeout=T) == "n2"


def test_a_cancelled_agent_step_makes_its_procs_unreachable(
    slurm: Any, job: tuple[SlurmJob, JobState]
) -> None:
    slurm_job, state = job
    procs = state.trainers.spawn_procs({"gpus": 1}, name="workers")
    events = _watch(procs)
    actors = procs.spawn("node", Node)
    assert _nodes(actors) == ["n1", "n2", "n3"]
    step = slurm.kill_job_step(slurm_job.job_id, "n2")
    assert step.startswith(f"{slurm_job.job_id}.")
    wait_until(lambda: bool(events), T, "the owner's handler to hear of n2's step")
    assert events[0][1].kind == "unreachable" and events[0][1].host == "n2", events
    with pytest.raises(SupervisionError, match="unreachable"):
        actors.slice(hosts=1).node.call_one().get(timeout=T)
    assert actors.slice(hosts=2).node.call_one().get(timeout=T) == "n3"
    assert slurm_job.slurm_state() == "RUNNING"


def test_an_agent_step_killed_by_sigkill_has_its_run_directory_removed_from_its_node(
    slurm: Any, job: tuple[SlurmJob, JobState]
) -> None:
    slurm_job, _ = job
    agents = [pid for pid in slurm._node_processes("n2") if _is_agent(pid)]  # and fork server
    (agent,) = [pid for pid in agents if _processes.parent_of(pid) not in agents]
    (rundir,) = _run_dirs_of(agent)
    step = agent_step(slurm_job.job_id, "n2", slurm.environ())
    slurm.run(["scancel", "--signal=KILL", step])  # no time to clean up after itself
    wait_until(lambda: not Path(f"/proc/{agent}").exists(), T, "n2's agent to be killed")
    wait_until(lambda: not rundir.exists(), T, f"{rundir} of the killed agent to be removed")
    assert slurm_job.slurm_state() == "RUNNING"


def _is_agent(pid: int) -> bool:
    return b"meshvisor\0agent\0" in (_processes.read_proc(pid, "cmdline") or b"")


def _run_dirs_of(pid: int) -> list[Path]:
    """The run directories that process `pid` made (``meshvisor-*/owner.pid`` naming it)."""
    found = []
    for base in _processes.temp_bases(pid) | {tempfile.gettempdir()}:
        for entry in Path(base).glob("meshvisor-agent-*"):
            with contextlib.suppress(OSError):
                if (entry / "owner.pid").read_text().strip() == str(pid):
                    found.append(entry)
    return found


def test_failed_ranks_are_respawned_on_a_spare_node_by_hand(
    slurm: Any, job: tuple[SlurmJob, JobState]
) -> None:
    _, state = job
    procs = state.trainers.spawn_procs({"gpus": 2}, name="workers")
    events = _watch(procs)
    actors = procs.spawn("node", Node)
    assert _nodes(actors) == ["n1", "n1", "n2", "n2", "n3", "n3"]
    slurm.kill_node("n2")
    wait_until(lambda: len(events) == 2, T, "both ranks of n2 to be reported")
    procs.respawn(on=state.spare).get(timeout=T)
    assert _nodes(actors) == ["n1", "n1", "n4", "n4", "n3", "n3"]


def test_a_restart_policy_moves_the_ranks_of_a_lost_node_to_a_spare_then_escalates(
    slurm: Any, job: tuple[SlurmJob, JobState]
) -> None:
    _, state = job
    procs = state.trainers.spawn_procs(
        {"gpus": 1},
        name="workers",
        restart=RestartPolicy(max_restarts=5, within_s=60.0),
        spare_hosts=state.spare,
    )
    events = _watch(procs)
    actors = procs.spawn("node", Node)
    assert _nodes(actors) == ["n1", "n2", "n3"]
    killed_at = time.monotonic()
    slurm.kill_node("n2")
    # a call under way when the node dies fails; one made once the loss is known (while the
    # rank restarts) waits for it, and is answered from the spare
    wait_until(lambda: _answer(actors.slice(hosts=1)) == "n4", T, "rank 1 to come back on n4")
    print(
        f"rank of a killed node answered from the spare after {time.monotonic() - killed_at:.2f} s"
    )
    assert events == [], "a restart handled the loss: nothing reached the owner"
    assert _nodes(actors) == ["n1", "n4", "n3"]
    slurm.kill_node("n3")  # the spare is taken: this loss escalates, saying why
    wait_until(lambda: bool(events), T, "the loss of n3 to escalate")
    event = events[0][1]
    assert event.kind == "unreachable" and event.host == "n3", event
    assert "no spare host is left" in event.message, event
    assert actors.slice(hosts=0).node.call_one().get(timeout=T) == "n1"


def test_a_replica_group_with_a_spare_node_keeps_training_and_heals_on_it(
    slurm: Any, job: tuple[SlurmJob, JobState]
) -> None:
    pytest.importorskip("torch")
    import replica_actors as ra

    from recovery import ReplicaGroup

    _, state = job
    group = ReplicaGroup(
        state.trainers, ra.Trainer, replicas=3, min_replicas=2, spare_hosts=state.spare
    )
    try:
        while group.committed_steps < 3:
            group.step()
        slurm.kill_node("n2")
        deadline = time.monotonic() + 3 * T
        while not (group.committed_steps >= 8 and group.live() == (0, 1, 2)):
            assert time.monotonic() < deadline, (group.recoveries, group.outcomes[-3:])
            group.step()
        assert group.check_consistency() is None
        (recovery,) = group.recoveries
        assert recovery.replica == 1 and recovery.healed_at is not None, recovery
        assert "n2" in recovery.event, recovery
        assert _node_of(group, 1) == "n4"
        without = any(len(members) == 2 for _, members in group.history)
        assert without or recovery.in_flight, "trained on without it, or it joined in flight"
    finally:
        group.close()


def _node_of(group: Any, replica: int) -> str:
    """The SLURM node the procs of `replica` run on (from their environment)."""
    from mesh.testing import probe

    pid = int(next(iter(probe(group.replicas[replica]).get(timeout=T).values())))
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    names = [v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"SLURMD_NODENAME=")]
    return names[0] if names else ""


# -- without SLURM: daemon agents on loopback play the hosts ----------------------------------


class Pid(Actor):
    @endpoint
    def agent(self) -> int:
        return os.getppid()  # a proc's parent is its agent's fork server, a child of the agent


@pytest.fixture
def agents() -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """Three daemon agents on 127.0.0.1 (address, process), terminated afterwards."""
    folder = Path(RUN_BASE) / f"spares-{time.monotonic_ns()}"
    folder.mkdir()
    started = []
    for i in range(3):
        (folder / f"run{i}").mkdir(mode=0o700)
        command = [sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"]
        command += ["--rundir", str(folder / f"run{i}"), "--address-file", f"{folder}/a{i}"]
        started.append(subprocess.Popen(command))
    try:
        files = [folder / f"a{i}" for i in range(3)]
        wait_until(lambda: all(f.exists() and f.read_text().strip() for f in files), T, "agents")
        yield [(f.read_text().strip(), agent) for f, agent in zip(files, started, strict=True)]
    finally:
        for agent in started:
            agent.terminate()
        for agent in started:
            agent.wait(T)
        shutil.rmtree(folder, ignore_errors=True)


def test_respawn_on_moves_failed_ranks_to_the_hosts_named(agents: list[Any]) -> None:
    hosts = attach([address for address, _ in agents])
    procs = hosts.slice(hosts=slice(0, 2)).spawn_procs({"gpus": 2}, name="moving")
    try:
        events = _watch(procs)
        pids = procs.spawn("pid", Pid)
        before = list(pids.agent.call().get(timeout=T).values())
        os.kill(agents[1][1].pid, signal.SIGKILL)
        wait_until(lambda: len(events) == 2, T, "both ranks of the lost agent to be reported")
        assert all(e.kind == "unreachable" for _, e in events), events
        with pytest.raises(ValueError, match="not in proc mesh"):
            procs.respawn([7], on=hosts.slice(hosts=2))
        procs.respawn([2], on=hosts.slice(hosts=2)).get(timeout=T)  # one rank by hand...
        procs.respawn(on=hosts.slice(hosts=2)).get(timeout=T)  # ...then the rest
        after = list(pids.agent.call().get(timeout=T).values())
        assert after[:2] == before[:2] and len(set(after[2:])) == 1
        assert after[2] not in before, (before, after)  # on the third host now
    finally:
        procs.stop().get(timeout=T)


def test_a_lost_host_without_spares_is_retried_in_place_then_escalates(agents: list[Any]) -> None:
    """Without spare hosts a silent agent may only be cut off (a partition heals), so its
    ranks are re-spawned in place; an agent that stays dead ends in an escalation."""
    hosts = attach([address for address, _ in agents[:2]])
    policy = RestartPolicy(max_restarts=1, within_s=60.0)
    procs = hosts.spawn_procs({"gpus": 1}, name="stuck", restart=policy)
    try:
        events = _watch(procs)
        assert len(procs.spawn("pid", Pid).agent.call().get(timeout=T)) == 2
        os.kill(agents[1][1].pid, signal.SIGKILL)
        wait_until(lambda: bool(events), 3 * T, "the loss to escalate")
        assert "not restarted" in events[0][1].message, events
    finally:
        procs.stop().get(timeout=T)
    with pytest.raises(ValueError, match="restart policy"):
        hosts.spawn_procs(name="spares", spare_hosts=hosts)
