"""examples/torchft_interop.py end to end: the real torchft Lighthouse and Managers in meshvisor
actors; a replica SIGKILLed mid-step, re-spawned by meshvisor and healed by torchft.

Skipped where the optional extra is not installed (``pip install 'meshvisor[torchft]'``).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import meshvisor_processes, meshvisor_run_dirs
from polling import wait_until

pytest.importorskip("torchft", reason="needs the torchft extra: pip install 'meshvisor[torchft]'")

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torchft_interop.py"
RUN_TIMEOUT_S = 150.0
STEPS = 15


def _value(out: str, label: str) -> str:
    found = re.search(rf"^\s*{re.escape(label)}: (.*)$", out, re.MULTILINE)
    assert found, f"no {label!r} line in the summary"
    return found.group(1)


def test_a_killed_replica_is_respawned_and_healed_by_torchft() -> None:
    procs_before = set(meshvisor_processes())
    dirs_before = set(meshvisor_run_dirs())
    command = [sys.executable, str(EXAMPLE), "--replicas", "3", "--steps", str(STEPS)]
    command += ["--kills", "1", "--seed", "0", "--time-limit", "120"]
    # The suite's private XDG_RUNTIME_DIR comes with os.environ (see conftest).
    proc = subprocess.run(
        command,
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    out = proc.stdout
    context = f"exit status {proc.returncode}\n{out}\n--- stderr (end)\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, context
    assert out.rstrip().endswith("RESULT OK"), context

    # One SIGKILL, seen by the controller as a supervision failure of that replica's proc ...
    killed = re.findall(r"^step \d+: SIGKILL replica (\d) \(pid \d+\)$", out, re.MULTILINE)
    assert len(killed) == 1, context
    assert f"replica {killed[0]} lost: signal SIGKILL" in out, context
    assert _value(out, "supervision events handled").startswith("1: signal (SIGKILL)"), context
    # ... re-spawned, healed by torchft, and committing again.
    assert f"replica {killed[0]}'s replacement committed step" in out, context
    assert "(recovered 1/1)" in _value(out, "kill -> replacement's first commit"), context
    assert _value(out, "kills") == "1, other restarts: 0", context

    # The final check held: one step, at least the one asked for, and identical parameters.
    steps = ast.literal_eval(_value(out, "final manager steps"))
    digests = ast.literal_eval(_value(out, "final parameter digests"))
    assert len(steps) == len(digests) == 3, context
    assert len(set(steps)) == 1 and steps[0] >= STEPS, context
    assert len(set(digests)) == 1 and None not in digests, context
    assert _value(out, "same step and identical parameters") == "yes", context

    # Nothing of the run is left: no agent, fork server or proc, no run directory.
    wait_until(
        lambda: not set(meshvisor_processes()) - procs_before,
        10.0,
        "the example's meshvisor processes to exit",
    )
    assert not set(meshvisor_run_dirs()) - dirs_before
