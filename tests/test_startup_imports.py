"""What a host agent and its procs cost to start: modules that take start-up time but are
needed only when something is logged (structlog) or asked for (package metadata) stay out of
the agent, so that the agents of a SLURM job answer sooner (benchmarks/bench_slurm.py measures
it); a proc forked from the fork server imports nothing of the runtime itself, so that spawning
many stays cheap (benchmarks/bench_spawn.py). Logging itself is unchanged: a record at or above
the level is written as before."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
from actors import Echo
from hypothesis import given
from hypothesis import strategies as st

import mesh
import transport
from mesh.testing import stop_local_agent

#: What `meshvisor agent` imports before it forks its fork server, which inherits these.
BEFORE_FORK = (
    "import meshvisor._cli, mesh._agent.daemon, mesh._agent.warm_start as w; w.import_shared()"
)
#: What `meshvisor agent` imports before it listens.
AGENT_IMPORTS = f"{BEFORE_FORK}; import mesh._agent.host_agent"
#: What a fork server has imported when it forks a proc.
FORK_SERVER_IMPORTS = f"{BEFORE_FORK}; w.warm_up()"
#: The packages a proc runs on: none of their modules may be left for each proc to import.
RUNTIME_PACKAGES = ("mesh", "transport", "supervision", "anyio", "asyncio", "zmq", "cloudpickle")
LEVELS = ("debug", "info", "warning", "error", "critical")
#: Each logging method of a structlog bound logger, and the level it logs at.
METHODS = {
    "debug": "debug",
    "info": "info",
    "warning": "warning",
    "error": "error",
    "exception": "error",
    "critical": "critical",
}


def _modules_loaded_by(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running `code`."""
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_an_agent_starts_without_structlog_or_package_metadata() -> None:
    loaded = _modules_loaded_by(AGENT_IMPORTS)
    assert not {"structlog", "rich", "importlib.metadata"} & loaded


def test_an_agent_leaves_the_client_api_and_the_procs_runtime_to_its_fork_server() -> None:
    agent = _modules_loaded_by(AGENT_IMPORTS)
    procs_only = {"mesh._agent.proc_main", "mesh._engine.runtime", "anyio"}
    assert not procs_only & agent
    assert not {m for m in agent if m.startswith("mesh._api")}, "the agent loads the client API"
    assert {"cloudpickle", "zmq", "mesh._engine.messages"} <= agent  # what it runs on
    fork_server = _modules_loaded_by(FORK_SERVER_IMPORTS)
    assert procs_only | {"mesh._api.host_mesh", "anyio._backends._asyncio"} <= fork_server


def test_the_agent_forks_its_fork_server_before_its_own_imports_after_the_shared_ones() -> None:
    # the agent's own modules come after the fork, beside the fork server's warm-up, and
    # nothing both run on is left for each of them to import again
    before_fork = _modules_loaded_by(BEFORE_FORK)
    agent = _modules_loaded_by(AGENT_IMPORTS)
    procs = _modules_loaded_by("import mesh._agent.proc_main, anyio._backends._asyncio")
    assert "mesh._agent.host_agent" not in before_fork
    assert not (agent & procs) - before_fork, "imported twice: by the agent and its fork server"
    # zmq's monitor helpers and its ZAP thread (CURVE only) would bring zmq.asyncio; queries
    # to agents (detached meshes, workspaces) load their messages with the first one, and a
    # proc's debugger (pdb) with its first breakpoint
    rarely_used = {
        "zmq.asyncio",
        "mesh._engine.detached_messages",
        "mesh._engine.workspace_messages",
        "mesh._engine.debug_session",
        "pdb",
    }
    assert not rarely_used & (before_fork | procs)


def test_each_public_name_of_mesh_loads_at_its_first_use() -> None:
    assert not {m for m in _modules_loaded_by("import mesh") if m.startswith("mesh._")}
    # what a proc unpickling an actor class (based on `mesh.Actor`) loads: not the client API
    actor = _modules_loaded_by("from mesh import Actor, endpoint; print(Actor.__module__)")
    assert not {m for m in actor if m.startswith("mesh._api")}
    loaded = _modules_loaded_by("from mesh import this_host")
    assert {"mesh._api.host_mesh"} <= loaded


def test_public_names_loaded_beside_one_read_as_mesh_names() -> None:
    # ValueMesh comes with this_host's module: a call's result shows as mesh.ValueMesh
    code = "from mesh import this_host; import sys; print(sys.modules['mesh._values'].ValueMesh)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "<class 'mesh.ValueMesh'>", done.stderr


@given(name=st.sampled_from(mesh.__all__))
def test_each_public_name_of_mesh_is_the_object_of_its_home_module(name: str) -> None:
    value = getattr(mesh, name)
    assert value is getattr(importlib.import_module(mesh._HOMES[name]), name)
    assert name in dir(mesh)
    if isinstance(value, type) or inspect.isfunction(value):
        assert value.__module__ == "mesh"  # as users see it in reprs and tracebacks


def test_a_forked_proc_imports_nothing_of_the_runtime(make_procs: Callable[..., Any]) -> None:
    # a fresh agent: earlier tests' preloads (a replica group's `recovery`, say) stay in the
    # fork server of the agent this worker shares, and would count here as the proc's own.
    # Two procs: a request for many waits for the whole warm-up (a lone proc may not)
    stop_local_agent()
    echo = make_procs({"gpus": 2}).spawn("echo", Echo)
    loaded_by_rank = echo.modules.call().get(timeout=60).values()
    assert all(frozen > 0 for frozen in echo.frozen_objects.call().get(timeout=60).values())
    tests = os.path.dirname(os.path.abspath(__file__))
    the_actor = f"import sys; sys.path.insert(0, {tests!r}); import actors"
    warm = _modules_loaded_by(f"{FORK_SERVER_IMPORTS}; {the_actor}")
    for loaded in loaded_by_rank:
        assert {"actors", "anyio._backends._asyncio"} <= set(loaded)  # it ran the actor on anyio
        runtime = {m for m in set(loaded) - warm if m.split(".")[0] in RUNTIME_PACKAGES}
        assert not runtime, f"each proc imports these after its fork: {sorted(runtime)}"


def test_a_first_lone_proc_starts_beside_its_fork_server_warm_up(
    make_procs: Callable[..., Any],
) -> None:
    # served between two steps of the warm-up or after it: either way it runs its actor, and
    # the procs forked after it find the warm-up finished
    stop_local_agent()
    lone = make_procs({"gpus": 1}).spawn("lone", Echo)
    assert "anyio._backends._asyncio" in lone.modules.call_one().get(timeout=60)
    assert lone.frozen_objects.call_one().get(timeout=60) > 0  # its collector spares them too
    later = make_procs({"gpus": 2}).spawn("later", Echo)
    assert all(frozen > 0 for frozen in later.frozen_objects.call().get(timeout=60).values())


def test_structlog_is_imported_by_the_first_record_at_the_level() -> None:
    code = (
        "import sys, transport\n"
        "log = transport.get_logger('startup-test', job=7)\n"
        "log.info('below the default level')\n"
        "print('after info:', 'structlog' in sys.modules)\n"
        "log.warning('at the level', node='n1')\n"
        "print('after warning:', 'structlog' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
    )
    assert done.stdout.splitlines() == ["after info: False", "after warning: True"]
    (line,) = done.stderr.splitlines()
    assert "at the level" in line and "[warning" in line
    assert all(part in line for part in ("component=startup-test", "job=7", "node=n1"))


@pytest.mark.parametrize(("level", "warmed"), [("warning", True), ("error", False)])
def test_a_client_imports_structlog_beside_its_start_not_at_its_first_failure(
    level: str, warmed: bool
) -> None:
    """Its first supervision event is a warning: the logger that writes it is made on a
    thread when the session starts, where the level lets warnings through."""
    code = (
        "import sys, threading\n"
        "from mesh.testing import inbox_address, shutdown\n"
        "print('before:', 'structlog' in sys.modules)\n"
        "inbox_address()\n"  # the client's session starts
        "for thread in threading.enumerate():\n"
        "    if thread.name == 'meshvisor-log-warm-up':\n"
        "        thread.join(30)\n"
        "print('after:', 'structlog' in sys.modules)\n"
        "shutdown()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "MESHVISOR_LOG_LEVEL": level},
    )
    assert done.stdout.splitlines() == ["before: False", f"after: {warmed}"], done.stderr


@contextlib.contextmanager
def _logging_at(level: str) -> Iterator[io.StringIO]:
    """This process logs at `level`, as JSON, to the returned stream, for one block."""
    before = transport.transport_settings()
    transport.use_transport_settings(replace(before, log_level=level, log_format="json"))
    transport.reset_logging()
    try:
        with contextlib.redirect_stderr(io.StringIO()) as stream:
            yield stream
    finally:
        transport.use_transport_settings(before)
        transport.reset_logging()


@given(level=st.sampled_from(LEVELS), method=st.sampled_from(sorted(METHODS)))
def test_a_record_is_written_exactly_when_at_or_above_the_level(level: str, method: str) -> None:
    with _logging_at(level) as stream:
        getattr(transport.get_logger("levels").bind(step=3), method)("event", value=1)
    written = stream.getvalue().splitlines()
    if LEVELS.index(METHODS[method]) < LEVELS.index(level):
        assert written == []
    else:
        (record,) = (json.loads(line) for line in written)
        assert record["level"] == METHODS[method]
        assert (record["event"], record["value"], record["step"]) == ("event", 1, 3)
        assert record["component"] == "levels"
