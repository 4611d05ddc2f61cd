"""Procs started by a bootstrap command instead of a fork: the fork server still forks a child
(so that it reaps it and relays its output like any proc), which hands its configuration over
in a private file and executes the command; the command's Python runs `mesh.bootstrap_main`,
which reads the file and runs the proc exactly as a forked one (`proc_main.run_proc`)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, NoReturn

#: The environment variable naming the file of a launched proc's configuration.
CONFIG_ENV = "MESHVISOR_PROC_CONFIG"


def config_path(config: dict[str, Any]) -> str:
    """Where the configuration of the launched proc `config` is handed over (in the agent's
    private run directory; removed by the proc once read, or by the agent when it exits)."""
    return os.path.join(config["rundir"], f"{config['proc_id']}.bootstrap")


def launch_refusal(config: dict[str, Any]) -> str | None:
    """Why the bootstrap command of `config` cannot be started here (its program is not an
    executable file, or not on ``PATH``), or None. Checked before forking, so that the owner
    hears it at once."""
    program = config["bootstrap"][0]
    path = {**os.environ, **config["env"]}.get("PATH", os.defpath)
    if shutil.which(program, path=path) is not None:
        return None
    where = "" if "/" in program else " on PATH"
    return (
        f"the bootstrap command {program!r} cannot be run: no executable file of that "
        f"name{where} on host agent {os.uname().nodename}"
    )


def exec_bootstrap(config: dict[str, Any]) -> NoReturn:
    """In the child forked for a launched proc: hand its configuration over and become its
    bootstrap command. Exits 127, saying why, if the command cannot be executed."""
    program, arg0, *args = config["bootstrap"]
    path = config_path(config)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as handover:
            json.dump(config, handover)
        env = {**os.environ, **config["env"], CONFIG_ENV: path}
        os.execvpe(program, [arg0, *args], env)
    except OSError as exc:
        print(f"meshvisor: cannot run the bootstrap command {program!r}: {exc}", file=sys.stderr)
        sys.stderr.flush()
    os._exit(127)


def read_launch_config() -> dict[str, Any]:
    """In a launched proc: its configuration, read from the file its agent named (and removed:
    it is read once). The proc keeps its own interpreter's ``sys.path`` (its virtualenv) and
    adds the client's other entries (your code), never the client's installed packages."""
    path = os.environ.pop(CONFIG_ENV, None)
    if path is None:
        raise SystemExit(
            f"mesh.bootstrap_main runs a proc started by a host agent's bootstrap command; "
            f"{CONFIG_ENV} is not set, so this process was not started by one"
        )
    with open(path) as handover:
        config: dict[str, Any] = json.load(handover)
    os.unlink(path)
    own = list(sys.path)
    config["sys_path"] = own + [
        entry for entry in config["sys_path"] if entry not in own and not _installed(entry)
    ]
    return config


def _installed(entry: str) -> bool:
    """Whether `entry` of the client's ``sys.path`` holds installed packages or the standard
    library (the launched Python has its own)."""
    parts = entry.replace("\\", "/").split("/")
    return bool({"site-packages", "dist-packages"} & set(parts)) or any(
        part.startswith("python3") for part in parts[-2:]
    )
