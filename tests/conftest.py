"""Shared fixtures: real procs that are always stopped, and a leak check at session end.

Every meshvisor run directory this test session creates goes under one private base directory
(``XDG_RUNTIME_DIR`` is pointed there before anything imports a session), so the leak check can
tell our agents, fork servers, procs and run directories apart from those of any other
meshvisor program running on the same machine at the same time.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

import transport

# No per-example deadline: it is a timing assertion, and these tests run beside other work on
# two cores (every test is bounded by pytest-timeout instead).
settings.register_profile("meshvisor", deadline=None)
settings.load_profile("meshvisor")

#: Names the session's base to the processes it starts. Procs import test modules again (actor
#: classes defined there are pickled by reference), and with them this one: they reuse the
#: base instead of making one of their own that nobody would remove.
RUN_BASE_ENV = "MESHVISOR_TEST_RUN_BASE"
#: Written in the base, naming the session that made it (for the session-end leak check).
SESSION_FILE = ".session"


#: The pytest-xdist worker (``gw0``...) a base belongs to: each worker runs a session of its own,
#: with its own base, agents and leak check; the procs it starts inherit both variables.
RUN_BASE_WORKER_ENV = "MESHVISOR_TEST_RUN_BASE_WORKER"


def _make_run_base() -> tuple[str, bool]:
    """The session's private base directory, and whether this process made it."""
    inherited = os.environ.get(RUN_BASE_ENV)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if inherited and os.path.isdir(inherited) and os.environ.get(RUN_BASE_WORKER_ENV) == worker:
        return inherited, False
    base = tempfile.mkdtemp(prefix="mvt-")
    os.chmod(base, 0o700)
    Path(base, SESSION_FILE).write_text(inherited or base)
    os.environ[RUN_BASE_ENV] = base
    os.environ[RUN_BASE_WORKER_ENV] = worker
    return base, True


# Must happen before the first mesh session exists (fixtures and tests create it lazily).
RUN_BASE, OWN_RUN_BASE = _make_run_base()
os.environ["XDG_RUNTIME_DIR"] = RUN_BASE
os.environ["MESHVISOR_LOG_DIR"] = os.path.join(RUN_BASE, "logs")  # procs' log files: not in ~
os.environ.pop("MESHVISOR_LOG_LEVEL", None)  # the suite checks that logs are quiet by default
# Every tcp connection is authenticated: this process (a client) and the agents the tests start
# share one CURVE key pair. Tests of keys give their subprocesses other keys, or none.
SUITE_KEYS = os.path.join(RUN_BASE, "keys")
if OWN_RUN_BASE:
    transport.CurveKeys.create(SUITE_KEYS)
    # pytest skips pytest_unconfigure after a usage error (an unknown option): still leave
    # nothing in /tmp
    atexit.register(shutil.rmtree, RUN_BASE, ignore_errors=True)
os.environ[transport.KEYS_ENV] = SUITE_KEYS


STOP_TIMEOUT_S = 30.0


def pytest_configure(config: pytest.Config) -> None:
    # pyproject turns warnings into errors. When a hypothesis test fails, hypothesis' pytest
    # plugin touches mypy_extensions.TypedDict while building the report; the resulting
    # DeprecationWarning would turn one failing test into an INTERNALERROR of the whole run.
    config.addinivalue_line(
        "filterwarnings", "ignore:mypy_extensions.TypedDict is deprecated:DeprecationWarning"
    )
    config.addinivalue_line("markers", "xdist_group(name): run on one pytest-xdist worker")
    # tmp_path directories go under the private base too, removed with it at the end
    # (pytest's default keeps the last runs' directories in /tmp/pytest-of-USER).
    if config.option.basetemp is None:
        config.option.basetemp = os.path.join(RUN_BASE, "tmp")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 2 --dist loadgroup``): the tests of one file run on one worker,
    so that a module's fixtures are set up once, and every test of the SLURM cluster on the
    same worker, so that the session starts one cluster, not one per worker."""
    for item in items:
        uses_slurm = "slurm_cluster" in getattr(item, "fixturenames", ())
        group = "slurm" if uses_slurm else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_unconfigure(config: pytest.Config) -> None:
    # Also when no test ran (--collect-only, a collection error): leave nothing in /tmp.
    if OWN_RUN_BASE:
        shutil.rmtree(RUN_BASE, ignore_errors=True)


#: What the command line of a host agent holds, however it was started: ``meshvisor agent``
#: (the public command, also as ``python -m meshvisor agent``) or the module a client runs.
AGENT_COMMANDS = ("meshvisor agent", "mesh._agent")


def meshvisor_processes(marker: str = RUN_BASE) -> list[tuple[int, str]]:
    """(pid, cmdline) of live host agent processes whose command line names `marker` (the
    agent, its fork server and its procs all share the agent's command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        cmdline = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        if any(command in cmdline for command in AGENT_COMMANDS) and marker in cmdline:
            found.append((int(entry.name), cmdline))
    return found


def meshvisor_run_dirs() -> list[str]:
    return sorted(str(p) for p in Path(RUN_BASE).glob("meshvisor-*"))


#: Each run directory seen, with where it was first seen: "during TEST" or "before TEST" (made
#: by fixtures or the teardown of the test before), so that a leak names its maker.
FIRST_SEEN: dict[str, str] = {}


@pytest.fixture(autouse=True)
def note_run_dirs(request: pytest.FixtureRequest) -> Iterator[None]:
    """Notes the run directories that appear around each test (for the session-end check)."""
    for found in meshvisor_run_dirs():
        FIRST_SEEN.setdefault(found, f"before {request.node.nodeid}")
    yield
    for found in meshvisor_run_dirs():
        FIRST_SEEN.setdefault(found, f"during {request.node.nodeid}")


def seen_where(dirs: list[str]) -> list[str]:
    """`dirs`, each with where the session first saw it."""
    return [f"{found} (first seen {FIRST_SEEN.get(found, 'at session end')})" for found in dirs]


def other_run_bases() -> list[str]:
    """Bases that processes of this session made besides `RUN_BASE` (they name it in their
    session file): each one is a leak, as nothing removes it."""
    found = []
    for session_file in Path(tempfile.gettempdir()).glob(f"mvt-*/{SESSION_FILE}"):
        try:
            if session_file.read_text() == RUN_BASE and str(session_file.parent) != RUN_BASE:
                found.append(str(session_file.parent))
        except OSError:
            continue
    return sorted(found)


@pytest.fixture(scope="session", autouse=True)
def no_leaks_at_session_end() -> Iterator[None]:
    """After the whole session: close the client session, then nothing of ours may be left:
    no agent, fork server or proc process, no run directory, and no base directory that a
    process of the session made besides `RUN_BASE`."""
    yield
    import mesh.testing

    shutdown_error: BaseException | None = None
    try:
        mesh.testing.shutdown()
    except BaseException as exc:  # still look for (and clean up) what it left behind
        shutdown_error = exc
    owned = meshvisor_processes(f"--owner-pid {os.getpid()}")  # also outside RUN_BASE
    leftovers = sorted(set(meshvisor_processes()) | set(owned))
    dirs = meshvisor_run_dirs()
    bases = other_run_bases()
    for pid, _ in leftovers:  # do not leave them behind for the next run either
        with contextlib.suppress(OSError):
            os.kill(pid, 9)
    for base in [RUN_BASE, *bases]:
        shutil.rmtree(base, ignore_errors=True)
    assert shutdown_error is None, f"closing the client session failed: {shutdown_error!r}"
    assert not leftovers, f"meshvisor processes left behind after the test session: {leftovers}"
    assert not dirs, (
        f"meshvisor run directories left behind after the test session: {seen_where(dirs)}"
    )
    assert not bases, f"processes of the test session made base directories of their own: {bases}"


# -- procs ------------------------------------------------------------------------------------


@pytest.fixture
def make_procs() -> Iterator[Callable[..., Any]]:
    """A factory of proc meshes; every mesh it made is stopped after the test, pass or fail."""
    from mesh import this_host

    made: list[Any] = []

    def make(per_host: dict[str, int] | None = None, **kwargs: Any) -> Any:
        procs = this_host().spawn_procs(per_host=per_host or {"gpus": 2}, **kwargs)
        made.append(procs)
        return procs

    yield make
    errors = []
    for procs in reversed(made):
        try:
            procs.stop().get(timeout=STOP_TIMEOUT_S)
        except Exception as exc:  # report every mesh that failed to stop, not just the first
            errors.append(f"{procs!r}: {exc!r}")
    assert not errors, f"proc meshes did not stop: {errors}"


@pytest.fixture
def procs(make_procs: Callable[..., Any]) -> Any:
    """A fresh mesh of two procs, ``{"gpus": 2}``, stopped after the test."""
    return make_procs({"gpus": 2})


@pytest.fixture
def agent_capfd(capfd: pytest.CaptureFixture[str]) -> Iterator[Callable[[], Any]]:
    """A function that restarts the local host agent under `capfd` and returns `capfd`.

    The agent relays proc output to the file descriptors it inherited when it started, and
    pytest gives `capfd` fresh files in each test phase, so a test that checks proc output must
    call this in its body. The agent is restarted again afterwards, so that later tests' proc
    output goes to pytest's normal capture.
    """
    from mesh import this_host
    from mesh.testing import stop_local_agent

    def start() -> pytest.CaptureFixture[str]:
        stop_local_agent()
        this_host()  # the new agent inherits the capturing file descriptors
        return capfd

    yield start
    stop_local_agent()


@pytest.fixture
def root_events() -> Iterator[list[Any]]:
    """Failures that reached the client's unhandled-failure hook (recorded and handled)."""
    import supervision

    events: list[Any] = []

    def record(event: Any) -> bool:
        events.append(event)
        return True

    previous = supervision.set_unhandled_failure_hook(record)
    try:
        yield events
    finally:
        supervision.set_unhandled_failure_hook(previous)


@pytest.fixture
def no_failure_reaches_the_root(root_events: list[Any]) -> Iterator[None]:
    """No failure may reach the client root unless the test expects it (and clears it)."""
    yield
    assert not root_events, f"unexpected failures reached the client: {root_events}"


# -- SLURM --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Any]:
    """A private SLURM cluster of 4 nodes (n1..n4) for the whole session; SLURM's commands run
    by this process and its children use it (``SLURM_CONF``). Never skipped: SLURM is installed
    by tests/install-system-packages."""
    from job.testing import LocalSlurmCluster

    cluster = LocalSlurmCluster(4)
    cluster.start()
    os.environ.update(cluster.env)
    try:
        yield cluster
    finally:
        for name in cluster.env:
            os.environ.pop(name, None)
        cluster.stop()


@pytest.fixture
def slurm(slurm_cluster: Any, tmp_path: Path) -> Iterator[Any]:
    """The session's SLURM cluster for one test, with a private job directory (`slurm.jobs`,
    to pass as ``job_dir``); every job still queued or running afterwards is cancelled, and
    all four nodes are idle again before the next test."""
    slurm_cluster.jobs = tmp_path / "slurm-jobs"
    slurm_cluster.jobs.mkdir(mode=0o700)
    yield slurm_cluster
    slurm_cluster.restore(timeout_s=60.0)


@pytest.fixture
def groups() -> Iterator[list[Any]]:
    """The replica groups a test makes (it appends them), closed when the test ends."""
    made: list[Any] = []
    yield made
    for group in made:
        group.close()
