"""The life of one proc, from fork to exit: set up, say ready, serve actors until stopped."""

from __future__ import annotations

import os
import sys
from typing import Any

from transport import get_logger, reset_logging

from ._messages import ProcReady
from ._runtime import Runtime
from ._session import Session, install_session


def run_proc(config: dict[str, Any]) -> int:
    """Run a proc described by `config` (built by the host agent); returns the exit code."""
    os.environ.update(config["env"])
    sys.path[:] = list(config["sys_path"])
    os.chdir(config["cwd"])
    reset_logging()
    runtime = Runtime(config["address"], proc_id=config["proc_id"], agent=config["agent"])
    session = Session(runtime, rundir=config["rundir"], agent=config["agent"],
                      proc=(config["mesh_name"], tuple(config["labels"]),
                            tuple(config["sizes"]), config["rank"]))
    install_session(session)
    log = get_logger("mesh.proc", proc=config["proc_id"])
    runtime.send_message(config["owner"], ProcReady(config["proc_id"], runtime.address,
                                                    os.getpid(), runtime.hostname))
    log.info("proc_started", mesh=config["mesh_name"], rank=config["rank"])
    try:
        runtime.run()
    finally:
        session.close()
    log.info("proc_exiting")
    return 0
