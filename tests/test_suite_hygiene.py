"""The test suite's own hygiene: what its processes leave in /tmp."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import RUN_BASE, other_run_bases


def test_a_process_importing_conftest_again_reuses_the_sessions_base() -> None:
    """Procs import test modules (actor classes are pickled by reference), and with them
    conftest: they must reuse the session's base directory, not make one nobody removes."""
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
    done = subprocess.run(
        [sys.executable, "-c", "import conftest; print(conftest.RUN_BASE)"],
        env=env,
        cwd=tests,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    made = done.stdout.strip()
    if made != RUN_BASE and Path(made).name.startswith("mvt-"):
        shutil.rmtree(made, ignore_errors=True)  # not left behind when this test fails
    assert made == RUN_BASE
    assert other_run_bases() == []
