"""The entry point of a proc started by a bootstrap command: ``python -m mesh.bootstrap_main``.

A `mesh.BootstrapCommand` (or `HostMesh.with_python_executable`) must end by running this
module; it joins the mesh exactly as a forked proc does (same address, authentication,
heartbeats and supervision). Run by hand, it explains that it needs a host agent.
"""

from __future__ import annotations

import sys

from mesh._agent.launching import read_launch_config
from mesh._agent.proc_main import run_proc


def main() -> None:
    """Run the proc its host agent described, then exit with its code."""
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    raise SystemExit(run_proc(read_launch_config()))


if __name__ == "__main__":
    main()
