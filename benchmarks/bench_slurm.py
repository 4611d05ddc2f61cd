"""SLURM: from ``SlurmJob(...)`` to the first call on 4 nodes, and from a node loss to the owner's
event and to the rank answering again on a spare, beside raw SLURM and Monarch 0.7.0's SlurmJob.

Starts its own private cluster (`job.testing.LocalSlurmCluster(4)`: slurmctld and 4 slurmd on
this machine) and, in the same run:

1. raw SLURM: ``sbatch --wrap 'srun -N4 true'``, submit -> batch script started -> 4-node step
   done (what SLURM itself costs); and the floor of a launcher with one Python per node: a batch
   script starting a step per node at once, each running ``python -c pass``;
2. meshvisor: ``SlurmJob({"hosts": 4}).state()`` -> procs + an actor on the 4 nodes answer a
   call, split into submit -> batch script runs (its output file appears), -> every agent
   answers, -> first call; the default job ends with its client and is granted by ``salloc``
   at once; a persistent one (a batch job, ``sbatch``) is measured too, for the notes;
3. meshvisor: a node of ``{"trainers": 3, "spare": 1}`` lost (SIGKILL of its slurmd, its job
   step's slurmstepd and every task process of the node) -> the caller's SupervisionError and
   the owner's ``on_failure`` event; then -> the rank answering again on the spare node;
4. Monarch 0.7.0's ``monarch.job.SlurmJob``: figures 2 and 3, run by Monarch's interpreter
   (``--monarch-peer``, one repetition per process).

Medians with min/max over ``--reps`` runs; ratios against the baseline of the same run. No
assertion on timing; the exit status is non-zero only when a measurement itself failed.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MONARCH_PYTHON = Path.home() / ".cache" / "meshvisor-peers" / "monarch" / "bin" / "python"
#: The node lost in the node-loss figures: the last trainer (not the first node, which runs the
#: batch script, and not the spare).
VICTIM = "n3"
#: How long the Monarch client's in-flight call to the lost node is waited for.
MONARCH_WAIT_S = 30.0


def kill_node(node: str, conf: str) -> float:
    """SIGKILL everything of `node` of the cluster configured by `conf`, as a lost machine looks:
    its slurmd, its job steps' slurmstepd and every process of the node's tasks. Returns the
    ``perf_counter`` just before the first kill."""
    # What LocalSlurmCluster.kill_node does; written out here because the Monarch peer runs in
    # Monarch's environment, where meshvisor is not installed.
    conf_var = f"SLURM_CONF={conf}".encode()
    node_var = f"SLURMD_NODENAME={node}".encode()
    tasks, daemons = [], []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if conf_var not in env:
            continue
        if node_var in env:
            tasks.append(int(entry))
        elif Path(argv[0].decode(errors="replace")).name == "slurmd" and node.encode() in argv:
            daemons.append(int(entry))
    for pid in list(tasks):
        with contextlib.suppress(OSError, ValueError):
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if Path(f"/proc/{ppid}/comm").read_text().strip() == "slurmstepd":
                daemons.append(ppid)
    start = time.perf_counter()
    for pid in dict.fromkeys(daemons + tasks):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return start


def _sleep_call(fut: Any, timeout: float) -> tuple[float | None, str]:
    """Wait for a call expected to fail: (perf_counter when it failed, what it raised)."""
    try:
        fut.get(timeout=timeout)
    except TimeoutError:
        return None, f"nothing raised within {timeout:g} s"
    except Exception as error:
        return time.perf_counter(), f"{type(error).__name__}: {str(error)[:160]}"
    return None, "the call returned"


def _wait_for(check: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.002)
    return False


# -- raw SLURM ----------------------------------------------------------------------------------


def raw_slurm(env: dict[str, str], work: Path, rep: int) -> dict[str, float]:
    """sbatch a 4-node job running one 4-node srun step; times from the files its script writes."""
    started, done = work / f"raw{rep}.started", work / f"raw{rep}.done"
    wrap = (
        f"date +%s.%N > {started}; srun -N4 --ntasks-per-node=1 true; "
        f"date +%s.%N > {done}.tmp; mv {done}.tmp {done}"
    )
    t0 = time.time()
    subprocess.run(
        ["sbatch", "--parsable", "-N4", f"--output={work}/raw{rep}.out", "--wrap", wrap],
        env=env,
        check=True,
        capture_output=True,
        timeout=30,
    )
    if not _wait_for(done.exists, 60):
        raise TimeoutError(f"the raw SLURM job {rep} did not finish within 60 s; see {work}")
    t_start, t_done = float(started.read_text()), float(done.read_text())
    return {"running": t_start - t0, "step": t_done - t_start, "total": t_done - t0}


def raw_python(env: dict[str, str], work: Path, rep: int) -> dict[str, float]:
    """The floor of any launcher with a Python process per node: a batch script starting one
    job step per node at once (as meshvisor's does), each running ``python -c pass`` with
    meshvisor's interpreter and environment; submit -> batch script runs -> all four ended."""
    started, done = work / f"py{rep}.started", work / f"py{rep}.done"
    python = shlex.quote(sys.executable)
    wrap = (
        f"date +%s.%N > {started}; "
        "for node in $(scontrol show hostnames $SLURM_JOB_NODELIST); do "
        f"srun -N1 -n1 --nodelist=$node --overlap {python} -c pass & done; wait; "
        f"date +%s.%N > {done}.tmp; mv {done}.tmp {done}"
    )
    t0 = time.time()
    subprocess.run(
        ["sbatch", "--parsable", "-N4", f"--output={work}/py{rep}.out", "--wrap", wrap],
        env=env,
        check=True,
        capture_output=True,
        timeout=30,
    )
    if not _wait_for(done.exists, 60):
        raise TimeoutError(f"the Python floor job {rep} did not finish within 60 s; see {work}")
    t_start, t_done = float(started.read_text()), float(done.read_text())
    return {"running": t_start - t0, "step": t_done - t_start, "total": t_done - t0}


# -- meshvisor ----------------------------------------------------------------------------------


def _actor_class() -> Any:
    from mesh import Actor, endpoint

    class Node(Actor):
        @endpoint
        def node(self) -> str:
            return os.environ.get("SLURMD_NODENAME", "?")

        @endpoint
        def sleep(self, seconds: float) -> int:
            time.sleep(seconds)
            return 1

    return Node


def ours_first_call(jobs: Path, rep: int, persistent: bool = False) -> dict[str, float]:
    """SlurmJob({"hosts": 4}).state() to an actor on each of the 4 nodes answering (a job
    ending with its client, granted at once by salloc; `persistent`: a batch job)."""
    from job import SlurmJob

    marks: dict[str, float] = {}
    submitted = threading.Event()

    def progress(line: str) -> None:
        if "submitted" in line:
            submitted.set()
        elif "agents answer" in line:
            marks.setdefault("agents", time.perf_counter())

    def watch_batch_start() -> None:
        """When slurmstepd creates the job's output file: the batch script runs."""
        submitted.wait(60)
        output = job.output_file
        if output is not None and _wait_for(output.exists, 60):
            marks["running"] = time.perf_counter()

    t0 = time.perf_counter()
    job = SlurmJob(
        {"hosts": 4}, name=f"bench-{rep}", job_dir=jobs, progress=progress, persistent=persistent
    )
    watcher = threading.Thread(target=watch_batch_start, daemon=True)
    watcher.start()
    try:
        state = job.state(timeout_s=120)
        procs = state.hosts.spawn_procs({"gpus": 1}, name="bench")
        nodes = procs.spawn("node", _actor_class()).node.call().get(timeout=60)
        t_end = time.perf_counter()
        if sorted(nodes.values()) != ["n1", "n2", "n3", "n4"]:
            raise RuntimeError(f"the actors answered from {list(nodes.values())}, not n1..n4")
        procs.stop().get(timeout=30)
    finally:
        job.cancel()
        watcher.join(5)
    running = marks.get("running", marks["agents"])
    return {
        "running": running - t0,
        "agents": marks["agents"] - running,
        "call": t_end - marks["agents"],
        "total": t_end - t0,
    }


def ours_node_loss(jobs: Path, conf: str, rep: int) -> dict[str, Any]:
    """A call in flight on the trainer of VICTIM; the node is lost; caller, owner, re-spawn."""

    from job import SlurmJob

    events: list[tuple[float, str]] = []

    def on_failure(event: object) -> bool:
        events.append((time.perf_counter(), str(event)))
        return True

    job = SlurmJob({"trainers": 3, "spare": 1}, name=f"loss-{rep}", job_dir=jobs, progress=None)
    result: dict[str, Any] = {}
    try:
        state = job.state(timeout_s=120)
        rank = state.nodes["trainers"].index(VICTIM)
        procs = state.trainers.spawn_procs({"gpus": 1}, name="trainers")
        procs.on_failure(on_failure)
        actors = procs.spawn("node", _actor_class())
        victim = actors.slice(hosts=rank)
        assert victim.node.call_one().get(timeout=30) == VICTIM
        in_flight = victim.sleep.call_one(60.0)
        time.sleep(0.3)  # let the call reach the actor (a benchmark, not a test)
        t_kill = kill_node(VICTIM, conf)
        t_caller, raised = _sleep_call(in_flight, 60)
        _wait_for(lambda: bool(events), 60)
        result["caller"] = t_caller - t_kill if t_caller else None
        result["raised"] = raised
        result["owner"] = events[0][0] - t_kill if events else None
        result["event"] = events[0][1][:200] if events else "no event within 60 s"
        result["names_node"] = bool(events) and VICTIM in events[0][1]
        if events:
            procs.respawn([rank], on=state.spare).get(timeout=60)  # type: ignore[call-arg]
            where = victim.node.call_one().get(timeout=60)
            result["respawn"] = time.perf_counter() - events[0][0]
            result["respawned_on"] = where
        with contextlib.suppress(Exception):
            procs.stop().get(timeout=10)
    finally:
        job.cancel(wait_s=5)
    return result


# -- Monarch 0.7.0 (run by Monarch's interpreter: --monarch-peer) --------------------------------


def _monarch_adapt(base_port: int) -> list[str]:
    """Make Monarch 0.7.0's SlurmJob run on a one-machine cluster; returns what was changed."""
    import monarch._src.job.slurm as ms

    changes = []
    original_info = ms.SlurmJob._get_job_info_json

    def job_info(self: Any, job_id: str) -> dict[str, Any] | None:
        info = original_info(self, job_id)
        if info is None or info.get("job_id") not in (None, int(job_id)):
            # SLURM 22.05's squeue --job ID --json may list other jobs too
            data = json.loads(subprocess.run(["squeue", "--json"], capture_output=True).stdout)
            info = next((j for j in data["jobs"] if j.get("job_id") == int(job_id)), None)
        resources = (info or {}).get("job_resources", {})
        if isinstance(resources.get("nodes"), str):  # SLURM 22.05 (openapi v0.0.38)
            names = [n["nodename"] for n in resources.get("allocated_nodes", [])]
            resources["nodes"] = {"allocation": [{"name": n} for n in names]}
        return info

    ms.SlurmJob._get_job_info_json = job_info
    changes.append("squeue --json of SLURM 22.05 converted to the layout Monarch reads")
    original_attach = ms.attach_to_workers

    def attach(name: str, ca: str, workers: list[str]) -> Any:
        def one(address: str) -> str:
            return re.sub(
                r"tcp://n(\d+):\d+", lambda m: f"tcp://127.0.0.1:{base_port + int(m[1])}", address
            )

        return original_attach(name=name, ca=ca, workers=[one(w) for w in workers])

    ms.attach_to_workers = attach
    changes.append("one worker port per node (all nodes share one host here)")
    return changes


def _monarch_worker_main() -> None:
    """The `python_exe` of the Monarch job's workers: Monarch's own worker bootstrap, listening
    on 127.0.0.1 and this node's own port instead of the machine's hostname and one port."""
    base, code = int(sys.argv[2]), sys.argv[sys.argv.index("-c") + 1]
    port = base + int(os.environ["SLURMD_NODENAME"].lstrip("n"))
    code = code.replace(f"{{socket.gethostname()}}:{base}", f"127.0.0.1:{port}")
    os.execv(sys.executable, [sys.executable, "-c", code])


def monarch_peer(figure: str, conf: str, base_port: int, adapt: bool) -> dict[str, Any]:
    """One repetition of `figure` (first-call | node-loss) with Monarch 0.7.0's SlurmJob."""
    import monarch._src.actor.supervision as sup
    import monarch.actor as ma
    from monarch.actor import Actor, endpoint
    from monarch.job import SlurmJob

    faults: list[tuple[float, str]] = []

    def hook(failure: object) -> None:
        faults.append((time.perf_counter(), str(failure)))

    ma.unhandled_fault_hook = hook  # type: ignore[attr-defined]
    sup.unhandled_fault_hook = hook  # type: ignore[assignment]
    changes = _monarch_adapt(base_port) if adapt else []
    import monarch._src.job.slurm as ms

    marks: dict[str, float] = {}
    original_wait = ms.SlurmJob._wait_for_job_start

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        hosts = original_wait(self, *args, **kwargs)
        marks.setdefault("running", time.perf_counter())
        return hosts

    ms.SlurmJob._wait_for_job_start = wait

    class Node(Actor):
        @endpoint
        def node(self) -> str:
            return os.environ.get("SLURMD_NODENAME", "?")

        @endpoint
        def sleep(self, seconds: float) -> int:
            time.sleep(seconds)
            return 1

    python = f"{sys.executable} {Path(__file__).resolve()} --monarch-worker {base_port}"
    job = SlurmJob(
        {"hosts": 4},
        python_exe=python if adapt else sys.executable,
        monarch_port=base_port,
        log_dir=os.getcwd(),
        job_start_timeout=60,
        exclusive=False,
    )
    if adapt:  # SlurmJob() configured TcpWithHostname; this machine's name is only loopback
        from monarch._rust_bindings.monarch_hyperactor.channel import ChannelTransport
        from monarch._rust_bindings.monarch_hyperactor.config import configure

        configure(default_transport=ChannelTransport.TcpWithLocalhost)
        changes.append("the client's transport TcpWithLocalhost (the hostname is loopback only)")
    result: dict[str, Any] = {"adapted": changes}
    t0 = time.perf_counter()
    try:
        state = job.state()
        t_state = time.perf_counter()
        procs = state.hosts.spawn_procs(per_host={"gpus": 1})
        actors = procs.spawn("node", Node)
        nodes = [v for _, v in actors.node.call().get(timeout=120)]
        t_end = time.perf_counter()
        running = marks.get("running", t_state)
        result.update(
            running=running - t0,
            agents=t_state - running,
            call=t_end - t_state,
            total=t_end - t0,
            nodes=sorted(nodes),
        )
        if figure == "node-loss":
            victim = actors.slice(hosts=int(VICTIM.lstrip("n")) - 1)
            assert victim.node.call_one().get(timeout=30) == VICTIM
            in_flight = victim.sleep.call_one(60.0)
            time.sleep(0.3)
            t_kill = kill_node(VICTIM, conf)
            t_caller, raised = _sleep_call(in_flight, MONARCH_WAIT_S)
            _wait_for(lambda: bool(faults), 5 if t_caller else 0)
            if t_caller is None:  # a new call to the lost node, after the wait
                result["new_call"] = _sleep_call(victim.node.call_one(), 10)[1]
            result["caller"] = t_caller - t_kill if t_caller else None
            result["raised"] = raised
            result["owner"] = faults[0][0] - t_kill if faults else None
            result["event"] = faults[0][1][:200] if faults else "no unhandled_fault_hook call"
            result["names_node"] = bool(faults) and VICTIM in faults[0][1]
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    finally:
        job.kill()
    return result


def run_monarch(figure: str, conf: str, work: Path, adapt: bool) -> dict[str, Any]:
    """Run one Monarch repetition in Monarch's interpreter (its own cwd: it caches job state)."""
    cwd = Path(tempfile.mkdtemp(prefix=f"monarch-{figure}-", dir=work))
    port = _free_port_base()
    command = [str(MONARCH_PYTHON), str(Path(__file__).resolve()), "--monarch-peer", figure]
    command += ["--conf", conf, "--port", str(port)] + ([] if adapt else ["--as-is"])
    env = {**os.environ, "SLURM_CONF": conf, "PYTHONPATH": ""}
    try:
        done = subprocess.run(
            command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired:
        return {"error": "Monarch's run did not end within 240 s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH ")]
    if not lines:
        tail = " / ".join(done.stderr.strip().splitlines()[-3:])
        return {"error": f"exit {done.returncode}: {tail[:300]}"}
    result: dict[str, Any] = json.loads(lines[-1][6:])
    said = [ln for ln in done.stderr.splitlines() if re.match(r"(SLURM job|Error|Failed)", ln)]
    if "error" in result and said:  # what Monarch logged on the way
        result["error"] += " (Monarch logged: " + " / ".join(said[-3:])[:300] + ")"
    logs = sorted(cwd.glob("slurm_*.err"))
    if "error" in result and logs:
        errors = [ln for ln in logs[-1].read_text().splitlines() if "Error" in ln]
        result["worker_log"] = " / ".join(dict.fromkeys(errors))[:300]
    return result


def _free_port_base() -> int:
    """A base port b with b+1..b+4 free (the Monarch workers' ports)."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 8 > 65535:
            continue
        try:
            for k in range(1, 5):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
    return 32000


# -- the table ----------------------------------------------------------------------------------


def _stat(values: list[float | None], scale: float = 1.0) -> str:
    got = [v * scale for v in values if v is not None]
    if not got:
        return f"{'-':>22}"
    return f"{statistics.median(got):8.3f} [{min(got):.3f}-{max(got):.3f}]".rjust(22)


def _median(values: list[Any]) -> float | None:
    got = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(got) if got else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"x{a / b:.1f}" if a and b else "-"


def _first_call_table(rows: dict[str, list[dict[str, Any]]], reps: int) -> None:
    """Figure 1 beside raw SLURM, the Python floor and Monarch, and the ratios."""
    raw, floor, first = rows["raw"], rows["raw_python"], rows["first"]
    ok = [r for r in rows["monarch_first"] if "error" not in r]
    print(f"\nSLURM on a private 4-node cluster, {reps} runs each: median [min-max], seconds")
    print(
        f"{'figure':42} {'raw SLURM':>22} {'SLURM + 4 Pythons':>22} {'meshvisor':>22} "
        f"{'Monarch 0.7.0':>22}"
    )
    for label, key in (
        ("1a submit -> batch script runs", "running"),
        ("1b batch script -> step done / agents up", "agents"),
        ("1c agents up -> first call on 4 nodes", "call"),
        ("1  submit -> first call on 4 nodes", "total"),
        ("1' batch script runs -> first call", "launch"),
    ):
        cells = [
            _stat([_figure(r, key) for r in raw]) if key != "call" else "",
            _stat([_figure(r, key) for r in floor]) if key != "call" else "",
            _stat([_figure(r, key) for r in first]),
            _stat([_figure(r, key) for r in ok]) if key != "launch" else "",
        ]
        print(f"{label:42} " + " ".join(f"{cell:>22}" for cell in cells))
    total = {
        name: _median([r["total"] for r in got])
        for name, got in (("raw", raw), ("floor", floor), ("ours", first), ("monarch", ok))
    }
    print(
        f"   meshvisor's first call {_ratio(total['monarch'], total['ours'])} sooner than "
        f"Monarch (goal >= x3); at no cost over SLURM a launcher would be "
        f"{_ratio(total['monarch'], total['raw'])} sooner, with one Python per node "
        f"{_ratio(total['monarch'], total['floor'])}"
    )


def _figure(row: dict[str, Any], key: str) -> float | None:
    """One figure of a row: the raw jobs' step is their 1b; 1' is 1b + 1c."""
    if key == "agents" and "step" in row:
        return row["step"]  # type: ignore[no-any-return]
    if key == "launch":
        if "step" in row:
            return row["step"]  # type: ignore[no-any-return]
        return row["agents"] + row["call"] if "agents" in row else None
    return row.get(key)


def _node_loss_table(loss: list[dict[str, Any]], m_ok: list[dict[str, Any]]) -> None:
    print(f"\nnode {VICTIM} lost (slurmd, slurmstepd, tasks SIGKILLed): median [min-max], ms")
    print(f"{'figure':44} {'':>22} {'meshvisor':>22} {'Monarch 0.7.0':>22}")
    for label, key in (
        ("2  loss -> waiting caller's error", "caller"),
        ("2  loss -> owner's event (on_failure / hook)", "owner"),
    ):
        print(
            f"{label:44} {'':>22} {_stat([r.get(key) for r in loss], 1e3)} "
            f"{_stat([r.get(key) for r in m_ok], 1e3)}"
        )
    if all("respawn" in r for r in loss) and loss:
        print(
            f"{'3  event -> rank answers on the spare':44} {'':>22} "
            f"{_stat([r['respawn'] for r in loss], 1e3)} {'(no re-spawn)':>22}"
        )
    else:
        print(
            f"{'3  event -> rank answers on the spare':44} {'':>22} "
            f"{'n/a (respawn on another host not available)':>45}"
        )
    seen = [
        min(v for v in (r.get("caller"), r.get("owner")) if v is not None)
        for r in loss
        if r.get("caller") is not None or r.get("owner") is not None
    ]
    m_seen = [
        min(v for v in (r.get("caller"), r.get("owner")) if v is not None)
        for r in m_ok
        if r.get("caller") is not None or r.get("owner") is not None
    ]
    if m_ok and not m_seen and seen:
        bound = MONARCH_WAIT_S + 10
        print(
            f"   node loss seen >= x{bound / _median(seen):.0f} sooner than Monarch, which saw "
            f"nothing within {bound:g} s (goal >= x10)"
        )
    else:
        print(
            f"   node loss seen {_ratio(_median(m_seen), _median(seen))} sooner than Monarch "
            "(goal >= x10)"
        )


def print_table(rows: dict[str, list[dict[str, Any]]], reps: int) -> None:
    loss = rows["loss"]
    m_loss = rows["monarch_loss"]
    ok = [r for r in rows["monarch_first"] if "error" not in r]
    _first_call_table(rows, reps)
    m_ok = [r for r in m_loss if "error" not in r]
    if loss or m_loss:  # not measured with --first-call-only
        _node_loss_table(loss, m_ok)
    print("\nnotes:")
    print("  1a: slurmctld starts a batch job at its next scheduling pass, once a second: 0-1 s")
    print("      after the submission at random; 1' leaves it out. meshvisor's job (it ends with")
    print("      its client) is granted by salloc in the request: its 1a is salloc's answer")
    persistent = [r["total"] for r in rows["first_persistent"]]
    if persistent:
        print(
            f"  meshvisor, a persistent job (a batch job, sbatch): submit -> first call "
            f"{_stat(persistent).strip()} s"
        )
    print("  1a/1b: Monarch polls squeue every 2 s, so its workers start before it sees RUNNING;")
    print("         only the totals (row 1) compare")
    for r in loss[:1]:
        print(f"  meshvisor event: {r.get('event')!r} (names {VICTIM}: {r.get('names_node')})")
        print(f"  meshvisor caller: {r.get('raised')}")
        if "respawned_on" in r:
            print(f"  re-spawned rank answered from {r['respawned_on']}")
    for r in m_ok[:1]:
        print(f"  Monarch hook: {r.get('event')!r}")
        print(f"  Monarch caller: {r.get('raised')}")
        if "new_call" in r:
            print(f"  Monarch, a new call to {VICTIM} after that: {r['new_call']}")
    for r in (rows["monarch_as_is"] + rows["monarch_first"] + m_loss)[:3]:
        if "error" in r:
            print(f"  Monarch error: {r['error']}")
            if r.get("worker_log"):
                print(f"    worker log: {r['worker_log']}")
    for r in ok[:1]:
        for change in r.get("adapted", []):
            print(f"  Monarch adapted (not its timing): {change}")


def _compile_meshvisor() -> None:
    """Write meshvisor's bytecode caches where they are missing, as installing a package does:
    an environment with PYTHONDONTWRITEBYTECODE=1 (this one) would otherwise make every agent
    compile meshvisor's modules again (~0.1 s of CPU each), where Monarch's installed modules
    come compiled."""
    for package in ("transport", "supervision", "mesh", "job", "recovery", "chaos", "meshvisor"):
        compileall.compile_dir(str(ROOT / package), quiet=1)


def main() -> int:
    if sys.argv[1:2] == ["--monarch-worker"]:
        _monarch_worker_main()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the raw rows as JSON too")
    parser.add_argument("--no-monarch", action="store_true")
    parser.add_argument(
        "--first-call-only", action="store_true", help="figure 1 only (no node loss, no persistent)"
    )
    parser.add_argument(
        "--monarch-peer", choices=("first-call", "node-loss"), help=argparse.SUPPRESS
    )
    parser.add_argument("--monarch-worker", help=argparse.SUPPRESS)
    parser.add_argument("--conf", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=22222, help=argparse.SUPPRESS)
    parser.add_argument("--as-is", action="store_true", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.monarch_peer:
        result = monarch_peer(args.monarch_peer, args.conf, args.port, not args.as_is)
        print("BENCH " + json.dumps(result), flush=True)
        os._exit(0)  # Monarch's runtime may keep the process alive
    sys.path.insert(0, str(ROOT))
    _compile_meshvisor()
    from job.testing import LocalSlurmCluster

    rows: dict[str, list[dict[str, Any]]] = {
        k: []
        for k in (
            "raw",
            "raw_python",
            "first",
            "first_persistent",
            "loss",
            "monarch_first",
            "monarch_loss",
            "monarch_as_is",
        )
    }
    work = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    failed = False
    with LocalSlurmCluster(4) as cluster:
        os.environ.update(cluster.env)
        conf = str(cluster.conf)
        monarch = MONARCH_PYTHON.exists() and not args.no_monarch
        for rep in range(args.reps):
            print(f"run {rep + 1} of {args.reps}", file=sys.stderr, flush=True)
            for name, measure in (
                ("raw", lambda rep=rep: raw_slurm(cluster.environ(), work, rep)),
                ("raw_python", lambda rep=rep: raw_python(cluster.environ(), work, rep)),
                ("first", lambda rep=rep: ours_first_call(work, rep)),
                ("first_persistent", lambda rep=rep: ours_first_call(work, rep, True)),
                ("loss", lambda rep=rep: ours_node_loss(work, conf, rep)),
                ("monarch_as_is", lambda: run_monarch("first-call", conf, work, adapt=False)),
                ("monarch_first", lambda: run_monarch("first-call", conf, work, adapt=True)),
                ("monarch_loss", lambda: run_monarch("node-loss", conf, work, adapt=True)),
            ):
                if name.startswith("monarch") and not monarch:
                    continue
                if name == "monarch_as_is" and rep > 0:
                    continue
                if args.first_call_only and name in ("first_persistent", "loss", "monarch_loss"):
                    continue
                try:
                    rows[name].append(measure())
                except Exception as error:
                    print(f"{name}: {type(error).__name__}: {error}", file=sys.stderr)
                    failed = True
                cluster.restore()
    shutil.rmtree(work, ignore_errors=True)
    if not MONARCH_PYTHON.exists() and not args.no_monarch:
        rows["monarch_as_is"].append(
            {
                "error": f"Monarch 0.7.0 not installed at {MONARCH_PYTHON} "
                "(../shared/bench/vs_monarch.sh installs it)"
            }
        )
    print_table(rows, args.reps)
    if args.json:
        print(json.dumps(rows, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
