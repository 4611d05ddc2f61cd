"""The test suite's own hygiene: what its processes leave in /tmp, and how it reads output."""

from __future__ import annotations

import ast
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


def _polled_reads(path: Path) -> list[str]:
    """The ``readouterr()`` calls made inside a ``wait_until(...)`` in the file at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "wait_until":
            for inner in ast.walk(node):
                if isinstance(inner, ast.Call) and getattr(inner.func, "attr", "") == "readouterr":
                    found.append(f"{path.name}:{inner.lineno}")
    return found


def test_no_test_polls_captured_output_with_readouterr() -> None:
    """readouterr() reads the capture, then truncates it: what another thread (the client's
    loop thread) prints between the two is lost, and a wait for it times out. Tests wait on a
    `Tap` instead (``with tapped("stderr") as stderr: ...``, tests/taps.py)."""
    tests = Path(__file__).parent
    found = [where for path in sorted(tests.rglob("*.py")) for where in _polled_reads(path)]
    assert found == [], f"wait on a Tap (taps.tapped), not readouterr(), at {found}"
