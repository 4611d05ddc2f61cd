"""Actor lifecycle: ``__cleanup__``, `ActorMesh.initialized`, and aborting with a reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lifecycle_actors as la
import pytest

from mesh import ProcMesh, context
from supervision import SupervisionError

T = 60.0


def lines(path: Path) -> list[str]:
    return sorted(path.read_text().splitlines()) if path.exists() else []


def test_cleanup_runs_once_when_the_actors_stop(procs: ProcMesh, tmp_path: Path) -> None:
    record = tmp_path / "cleanup"
    actors = procs.spawn("clean", la.CleansUp, str(record))
    assert list(actors.ping.call().get(timeout=T).values()) == ["pong", "pong"]
    actors.stop().get(timeout=T)  # answered once the hooks have run
    assert lines(record) == ["0 NoneType None", "1 NoneType None"]
    procs.stop().get(timeout=T)  # stopping the procs does not run them again
    assert lines(record) == ["0 NoneType None", "1 NoneType None"]


def test_cleanup_runs_when_the_proc_is_stopped(make_procs: Any, tmp_path: Path) -> None:
    record = tmp_path / "cleanup"
    procs = make_procs({"gpus": 2})
    procs.spawn("clean", la.CleansUp, str(record)).ping.call().get(timeout=T)
    procs.spawn("aclean", la.AsyncCleansUp, str(record)).ping.call().get(timeout=T)
    procs.stop().get(timeout=T)
    assert lines(record) == [
        "0 NoneType None",
        "1 NoneType None",
        "async NoneType",
        "async NoneType",
    ]


def test_cleanup_gets_the_failure(make_procs: Any, tmp_path: Path) -> None:
    record = tmp_path / "cleanup"
    procs = make_procs({"gpus": 2})
    actors = procs.spawn("failing", la.CleansUp, str(record))
    with pytest.raises(SupervisionError):
        actors.slice(gpus=1).raise_base.call_one().get(timeout=T)
    with pytest.raises(Exception, match="only the call fails"):  # no cleanup: it lives on
        actors.slice(gpus=0).raise_value_error.call_one().get(timeout=T)
    procs.stop().get(timeout=T)  # waits for the failed actor's hook too
    assert lines(record) == ["0 NoneType None", "1 SystemExit fatal in endpoint"]


def test_a_cleanup_that_raises_is_logged_and_does_not_hang_the_stop(
    make_procs: Any, tmp_path: Path, agent_capfd: Any
) -> None:
    capfd = agent_capfd()  # first: it restarts the agent that the procs come from
    procs = make_procs({"gpus": 2})
    record = tmp_path / "cleanup"
    actors = procs.spawn("bad-clean", la.CleansUp, str(record), fail_in_cleanup=True)
    actors.stop().get(timeout=T)
    assert lines(record) == ["0 NoneType None", "1 NoneType None"]
    procs.stop().get(timeout=T)  # the proc's agent relays its output once it is gone
    err = capfd.readouterr().err
    assert err.count("actor_cleanup_failed") == 2
    assert "cleanup exploded" in err


def test_initialized_resolves_once_every_constructor_ran(procs: ProcMesh) -> None:
    actors = procs.spawn("built", la.SlowToBuild)
    assert actors.initialized.get(timeout=T) is None
    assert actors.slice(gpus=1).initialized.get(timeout=T) is None  # also later, and on a slice


def test_initialized_raises_the_constructor_failure_naming_the_rank(procs: ProcMesh) -> None:
    actors = procs.spawn("unbuilt", la.SlowToBuild, fail_on_rank=1)
    with pytest.raises(SupervisionError) as info:
        actors.initialized.get(timeout=T)
    assert dict(info.value.event.rank or {}) == {"gpus": 1}
    assert "rank 1 cannot be built" in str(info.value)
    assert "rank {'gpus': 1}" in str(info.value)
    with pytest.raises(SupervisionError):  # asked again after the failure: the same answer
        actors.slice(gpus=1).initialized.get(timeout=T)
    assert actors.slice(gpus=0).initialized.get(timeout=T) is None


def test_abort_fails_the_actor_with_its_reason(procs: ProcMesh) -> None:
    actors = procs.spawn("aborting", la.CleansUp, "/dev/null")
    with pytest.raises(SupervisionError) as info:
        actors.slice(gpus=0).abort.call_one("the data is corrupt").get(timeout=T)
    assert info.value.event.kind == "exception"
    assert "the actor aborted itself: the data is corrupt" in str(info.value)
    with pytest.raises(SupervisionError):
        actors.slice(gpus=0).ping.call_one().get(timeout=T)
    assert actors.slice(gpus=1).ping.call_one().get(timeout=T) == "pong"


def test_abort_is_not_swallowed_by_except_exception(procs: ProcMesh) -> None:
    actors = procs.spawn("catcher", la.CatchesEverything)
    with pytest.raises(SupervisionError, match="aborted itself: no way out"):
        actors.slice(gpus=1).abort.call_one("no way out").get(timeout=T)


def test_abort_in_the_constructor_is_a_constructor_failure(make_procs: Any) -> None:
    actors = make_procs({"gpus": 1}).spawn("aborted", la.AbortsInConstructor, "missing config")
    with pytest.raises(SupervisionError, match="aborted itself: missing config"):
        actors.initialized.get(timeout=T)


def test_abort_in_the_client_is_refused() -> None:
    with pytest.raises(RuntimeError, match="outside any actor"):
        context().actor_instance.abort("nothing to abort")
