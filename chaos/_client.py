"""The workload's client process: ``python -m chaos._client WORKLOAD --agents ...``.

Started (and, for a "kill_client" fault, killed and started again) by the harness: it attaches
to the harness's allocation, runs the workload function with a `Job`, and reports.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mesh import attach

from ._channel import CHANNEL_FD_ENV
from ._job import Job


def load_workload(reference: str) -> Callable[[Job], Any]:
    """The function named by `reference`: ``path/to/file.py:function`` or ``module:function``
    (``:workload`` when no function is named)."""
    where, _, name = reference.rpartition(":") if ":" in reference else (reference, "", "")
    name = name or "workload"
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.exists():
            raise FileNotFoundError(f"the workload script {where} does not exist")
        sys.path.insert(0, str(path.parent))  # its procs import its actors the same way
        module = importlib.import_module(path.stem)
    else:
        module = importlib.import_module(where)
    function: Any = module
    for part in name.split("."):
        function = getattr(function, part, None)
        if function is None:
            raise AttributeError(f"{where} has no function {name!r} (expected def {name}(job))")
    if not callable(function):
        raise TypeError(f"{reference} is not a function")
    return function  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos._client")
    parser.add_argument("workload")
    parser.add_argument("--agents", required=True, help="comma-separated agent addresses")
    parser.add_argument("--generation", type=int, default=0)
    parser.add_argument("--params", default="{}", help="the workload's job.params, as JSON")
    args = parser.parse_args(argv)
    channel = socket.socket(fileno=int(os.environ.pop(CHANNEL_FD_ENV)))
    agents = args.agents.split(",")
    job = Job(channel, attach(agents), agents, args.generation, json.loads(args.params))
    try:
        workload = load_workload(args.workload)
        workload(job)
    except BaseException as exc:
        job.crashed(exc)
        raise
    job.complete()
    return 0


if __name__ == "__main__":
    sys.exit(main())
