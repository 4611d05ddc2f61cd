"""The chaos harness's local allocation: daemon agents that never outlive the harness."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from polling import pid_alive, wait_until

pytestmark = pytest.mark.timeout(60)

HARNESS = textwrap.dedent(
    """
    import json, sys, time
    from chaos._allocation import LocalAllocation
    with LocalAllocation(2) as alloc:
        print(json.dumps([alloc.pid(0), alloc.pid(1), str(alloc.directory)]), flush=True)
        time.sleep(60)
    """
)


def test_agents_die_with_a_sigkilled_harness() -> None:
    harness = subprocess.Popen(
        [sys.executable, "-c", HARNESS], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    directory = None
    try:
        assert harness.stdout is not None
        first, second, directory = json.loads(harness.stdout.readline())
        assert pid_alive(first) and pid_alive(second)
        harness.kill()
        harness.wait(10)
        wait_until(
            lambda: not pid_alive(first) and not pid_alive(second),
            10,
            "the agents of a SIGKILLed harness to exit",
        )
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()
        assert harness.stdout is not None
        harness.stdout.close()
        if directory is not None:  # a SIGKILLed harness cannot remove it itself
            shutil.rmtree(directory, ignore_errors=True)
