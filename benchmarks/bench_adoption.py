"""Adoption of a detached mesh: kill the client, start a new one, adopt a 4-proc mesh, call it.

One ``meshvisor agent`` daemon (tcp on loopback, its own allocation file and keys). A first
client spawns a detached 4-proc mesh with one actor per proc and is SIGKILLed. Each trial
then starts a new client process that attaches, adopts the mesh, calls every actor once and
is SIGKILLed in turn, so that the next trial adopts from a dead client again. The clock runs
from the start of the new client's process to the answer of that call (the target, issue
#15, is <= 2 s), with zero worker restarts (the same pids in every trial, and the actors'
state carries on). The baseline, in the same run: a fresh client that spawns the same 4 procs
(not detached), spawns the actor and calls it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

TARGET_S = 2.0

ACTOR = """
import os, sys, time
T0 = time.perf_counter()
from mesh import Actor, attach, endpoint

class Counter(Actor):
    def __init__(self):
        self.calls = 0

    @endpoint
    def call(self):
        self.calls += 1
        return os.getpid(), self.calls

def report(counters, t_api):
    answers = counters.call.call().get(timeout=60).values()
    done = time.perf_counter()
    pids = [pid for pid, _ in answers]
    calls = [n for _, n in answers]
    print("RESULT", done - T0, done - t_api, *pids, "|", *calls, flush=True)
"""

DETACH = (
    ACTOR
    + """
hosts = attach({alloc!r})
procs = hosts.spawn_procs(per_host={{"gpus": 4}}, name="bench", detached=True)
report(procs.spawn("counters", Counter), time.perf_counter())
time.sleep(600)
"""
)

ADOPT = (
    ACTOR
    + """
hosts = attach({alloc!r})
t_api = time.perf_counter()
procs = hosts.adopt_procs("bench")
report(procs.actor_mesh("counters"), t_api)
time.sleep(600)
"""
)

FRESH = (
    ACTOR
    + """
hosts = attach({alloc!r})
t_api = time.perf_counter()
procs = hosts.spawn_procs(per_host={{"gpus": 4}}, name="fresh")
report(procs.spawn("counters", Counter), t_api)
procs.stop().get(timeout=60)
"""
)


def _run_client(script: Path, keep: bool) -> tuple[float, float, float, list[int], list[int]]:
    """Run a client until it reports; (wall s from its start, in-process s, API s, pids,
    calls). A `keep` client is SIGKILLed after reporting (it dies holding the mesh)."""
    start = time.perf_counter()
    client = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = client.stdout.readline()  # type: ignore[union-attr]
        wall = time.perf_counter() - start
        if not line.startswith("RESULT"):
            raise RuntimeError(f"the client did not report: {line!r}")
        fields = line.split()[1:]
        split = fields.index("|")
        pids = [int(p) for p in fields[2:split]]
        calls = [int(n) for n in fields[split + 1 :]]
        return wall, float(fields[0]), float(fields[1]), pids, calls
    finally:
        if keep:
            client.kill()
        client.wait(120)
        client.stdout.close()  # type: ignore[union-attr]


def _start_agent(folder: Path) -> subprocess.Popen[bytes]:
    (folder / "run").mkdir(mode=0o700)
    command = [sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"]
    command += ["--rundir", str(folder / "run"), "--allocation", str(folder / "hosts")]
    agent = subprocess.Popen(command)
    deadline = time.monotonic() + 60
    while not (folder / "hosts").exists() or not (folder / "hosts").read_text().strip():
        if time.monotonic() > deadline:
            raise RuntimeError("the agent did not start within 60 s")
        time.sleep(0.05)
    return agent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="meshvisor-bench-adopt-"))
    os.chmod(folder, 0o700)
    agent = _start_agent(folder)
    try:
        scripts = {}
        for name, text in (("detach", DETACH), ("adopt", ADOPT), ("fresh", FRESH)):
            scripts[name] = folder / f"{name}.py"
            scripts[name].write_text(textwrap.dedent(text).format(alloc=str(folder / "hosts")))
        _, _, _, pids, _ = _run_client(scripts["detach"], keep=True)
        adopt, fresh, restarts, calls = [], [], 0, 1
        for _ in range(args.trials):
            wall, _, api, got, counts = _run_client(scripts["adopt"], keep=True)
            calls += 1
            restarts += sum(1 for a, b in zip(got, pids, strict=True) if a != b)
            if counts != [calls] * len(pids):
                raise RuntimeError(f"the actors' state did not carry on: {counts}")
            adopt.append((wall, api))
            wall, _, api, _, _ = _run_client(scripts["fresh"], keep=False)
            fresh.append((wall, api))
        _stop_mesh(folder / "hosts")
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(60)
        shutil.rmtree(folder, ignore_errors=True)
    _report(adopt, fresh, restarts, args.json)
    return 0


def _stop_mesh(alloc: Path) -> None:
    command = [sys.executable, "-m", "meshvisor", "meshes", "stop", str(alloc), "bench"]
    subprocess.run(command, check=True, capture_output=True, timeout=120)


def _report(
    adopt: list[tuple[float, float]], fresh: list[tuple[float, float]], restarts: int, as_json: bool
) -> None:
    def med(values: list[tuple[float, float]], i: int) -> float:
        return statistics.median(v[i] for v in values)

    rows = {
        "adopt (kill client, new client adopts 4 procs, calls)": (med(adopt, 0), med(adopt, 1)),
        "baseline (new client spawns 4 procs + actors, calls)": (med(fresh, 0), med(fresh, 1)),
    }
    if as_json:
        print(json.dumps({"rows": rows, "worker_restarts": restarts, "target_s": TARGET_S}))
        return
    print(f"{'':56} {'client start->answer':>21} {'API call->answer':>17}")
    for name, (wall, api) in rows.items():
        print(f"{name:56} {wall:>19.3f} s {api:>15.3f} s")
    ratio = med(adopt, 0) / med(fresh, 0)
    print(f"ratio adopt/baseline (client start->answer): {ratio:.2f}")
    print(f"worker restarts over {len(adopt)} adoptions: {restarts}")
    verdict = "meets" if med(adopt, 0) <= TARGET_S and restarts == 0 else "MISSES"
    print(f"target: <= {TARGET_S:g} s from the new client's start, zero restarts: {verdict}")


if __name__ == "__main__":
    sys.exit(main())
