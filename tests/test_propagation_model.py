"""Escalation, checked against a tiny reference model.

The rule: a failure goes to the owner of what failed. An owner that handles it (truthy
``__supervise__``) stops it there; an owner that declines (falsy) or whose handler raises fails
itself, with an "escalated" event whose `cause` is the child's event, and that event goes on to
*its* owner. At the client root a mesh handler decides first, then the global hook.

`test_real_trees_follow_the_model` builds random small trees of real owner actors (client →
owner → owner → leaf, depth ≤ 3), kills the leaf's process and compares what every level's
handler saw, and what reached the root, with the model. `test_escalation_chains` checks the
pure functions `supervision.escalated` / `is_handled` over random chains.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import FrozenInstanceError, dataclass
from pathlib import Path
from typing import Any

import failing_actors as fa
import pytest
from conftest import RUN_BASE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import supervision
from mesh import this_host
from supervision import SupervisionEvent, escalated, is_handled

T = 30.0
DECISIONS = ("handle", "ignore", "raise")


# -- the reference model --------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What one failure of the leaf leads to."""

    asked: tuple[int, ...]  # owner levels whose __supervise__ ran, in order (deepest first)
    root_handler_asked: bool  # the client's mesh handler was consulted
    hook_asked: bool  # the failure reached the global unhandled-failure hook
    root_chain: tuple[str, ...]  # kinds of the event at the root, itself first ("" if none)
    alive: tuple[int, ...]  # owner levels still alive afterwards


def model(owners: list[str], root: str | None) -> Outcome:
    """`owners[i]` is the decision of the owner at level i + 1 (level 1 is spawned by the
    client); the leaf is owned by the last one (by the client if there are no owners). `root`
    is the client mesh handler's decision (None: no handler)."""
    asked: list[int] = []
    chain = ["signal"]
    for level in range(len(owners), 0, -1):
        asked.append(level)
        if owners[level - 1] == "handle":
            return Outcome(tuple(asked), False, False, (), tuple(range(1, level + 1)))
        chain.insert(0, "escalated")
    handled_at_root = root == "handle"
    return Outcome(tuple(asked), root is not None, not handled_at_root, tuple(chain), ())


# -- real trees ----------------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = T) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


trees = st.tuples(
    st.lists(st.tuples(st.sampled_from(DECISIONS), st.booleans()), min_size=0, max_size=2),
    st.sampled_from([None, *DECISIONS]),
    st.sampled_from(["SIGKILL", "SIGSEGV", "SIGTERM"]),
)


@settings(
    max_examples=8, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(tree=trees)
def test_real_trees_follow_the_model(tree: tuple[list[tuple[str, bool]], str | None, str]) -> None:
    owners, root, signame = tree
    expected = model([decision for decision, _ in owners], root)
    workdir = Path(tempfile.mkdtemp(prefix="model-", dir=RUN_BASE))  # removed with it at the end
    record = workdir / "record.jsonl"
    hooked: list[SupervisionEvent] = []
    root_asked: list[SupervisionEvent] = []
    lock = threading.Lock()

    def hook(event: SupervisionEvent) -> bool:
        with lock:
            hooked.append(event)
        return True

    def root_handler(event: SupervisionEvent) -> bool:
        with lock:
            root_asked.append(event)
        if root == "raise":
            raise RuntimeError("the root handler gives up")
        return root == "handle"

    previous = supervision.set_unhandled_failure_hook(hook)
    procs = this_host().spawn_procs(per_host={"gpus": 1}, name="level1")
    pids: list[int] = []
    try:
        if root is not None:
            procs.on_failure(root_handler)
        if owners:
            (decision, is_async), rest = owners[0], owners[1:]
            top = procs.spawn(
                "owner1", fa.AsyncOwner if is_async else fa.SyncOwner, str(record), decision, 1
            )
            pids = [top.pid.call_one().get(timeout=T)]
            pids += top.spawn_chain.call_one(rest, str(record)).get(timeout=T)
        else:
            top = procs.spawn("leaf", fa.Fragile)
            pids = [top.pid.call_one().get(timeout=T)]
        os.kill(pids[-1], getattr(signal, signame))

        # The failure has come to rest once an owner handled it or the root was reached.
        def settled() -> bool:
            handled = any(r["decision"] == "handle" for r in _records(record))
            return handled or bool(hooked) or (root == "handle" and bool(root_asked))

        _wait_until(settled, f"the failure of the leaf in tree {tree} to be decided")
        if expected.alive:  # a round trip through every owner still alive
            assert top.deep_ping.call_one().get(timeout=T) == list(expected.alive)

        records = _records(record)
        asked = tuple(r["level"] for r in records)
        assert asked == expected.asked, (tree, records)
        assert bool(root_asked) == expected.root_handler_asked, (tree, root_asked)
        assert bool(hooked) == expected.hook_asked, (tree, hooked)
        assert len(hooked) <= 1 and len(root_asked) <= 1, "each failure is decided once"
        # Every level saw the event of the level below it, with the leaf as root cause.
        for record_ in records:
            assert record_["event"]["chain"][-1] == "signal"
            assert record_["event"]["chain"] == ["escalated"] * (len(owners) - record_["level"]) + [
                "signal"
            ]
        at_root = (root_asked or hooked)[:1]
        if expected.root_chain:
            (event,) = at_root
            kinds = []
            cursor: SupervisionEvent | None = event
            while cursor is not None:
                kinds.append(cursor.kind)
                cursor = cursor.cause
            assert tuple(kinds) == expected.root_chain
            leaf = event.root_cause()
            assert (leaf.signal, leaf.pid) == (signame, pids[-1])
            # A leaf proc's death: the proc mesh's handler hears of the proc, the hook (for
            # the client that owns the actor mesh) of the actor.
            leaf_mesh = "level1" if root_asked else "leaf"
            assert event.mesh_name == ("owner1" if owners else leaf_mesh)
            report = event.report()
            assert report.index("Root cause:") < report.index(signame)
            if owners and owners[0][0] == "raise":
                assert "__supervise__ raised RuntimeError" in event.message
        else:
            assert at_root == []
    finally:
        # The hook stays until the tree is gone, so that even a failing example cannot let a
        # late escalation reach pytest's main thread.
        try:
            procs.stop().get(timeout=T)
            # A mesh never outlives its owner: everything below level 1 goes with it.
            _wait_until(
                lambda: not any(_pid_alive(p) for p in pids),
                f"the processes {pids} of tree {tree} to exit",
            )
        finally:
            supervision.set_unhandled_failure_hook(previous)
            shutil.rmtree(workdir, ignore_errors=True)


# -- the pure functions ---------------------------------------------------------------------------

decisions_values = st.one_of(
    st.booleans(),
    st.none(),
    st.integers(-2, 2),
    st.text(max_size=2),
    st.lists(st.integers(), max_size=1),
)


@settings(max_examples=200, deadline=None, database=None)
@given(
    levels=st.lists(st.tuples(decisions_values, st.booleans()), min_size=0, max_size=6),
    leaf_kind=st.sampled_from(
        ["exception", "exit", "signal", "hung", "unreachable", "spawn_failed"]
    ),
)
def test_escalation_chains(levels: list[tuple[Any, bool]], leaf_kind: str) -> None:
    """Propagate a leaf event through owners whose handlers return `decision` (or raise):
    the first truthy decision stops it; every other level wraps it in an escalation."""
    leaf = SupervisionEvent(
        leaf_kind,
        "leaf",
        rank={"gpus": 0},
        pid=100,
        host="h",
        signal="SIGKILL" if leaf_kind == "signal" else None,
        exit_code=3 if leaf_kind == "exit" else None,
        traceback="leaf traceback",
    )
    event = leaf
    stopped_at = None
    for index, (decision, raises) in enumerate(levels):
        if not raises and is_handled(decision):
            stopped_at = index
            break
        assert is_handled(decision) == bool(decision)
        own = SupervisionEvent(
            "exception", f"owner{index}", rank={"gpus": index}, pid=200 + index, host="h"
        )
        error = RuntimeError(f"handler {index} broke") if raises else None
        child = event
        event = escalated(child, own, error)
        assert event.kind == "escalated" and event.cause is child
        assert (event.mesh_name, event.pid, dict(event.rank or {})) == (
            f"owner{index}",
            200 + index,
            {"gpus": index},
        )
        assert child.mesh_name in event.message
        if raises:
            assert "RuntimeError" in event.message and f"handler {index} broke" in event.message
            assert f"handler {index} broke" in (event.traceback or "")
        with pytest.raises(FrozenInstanceError):
            event.kind = "signal"  # type: ignore[misc]
    # The reference: the index of the first level that handles it (by truthiness alone).
    reference = next((i for i, (d, r) in enumerate(levels) if not r and bool(d)), None)
    assert stopped_at == reference
    depth = len(levels) if reference is None else reference
    assert event.root_cause() is leaf
    chain = []
    cursor: SupervisionEvent | None = event
    while cursor is not None:
        chain.append(cursor)
        cursor = cursor.cause
    assert len(chain) == depth + 1
    report = event.report()
    lines = report.splitlines()
    assert lines[0] == "Supervision report"
    assert lines[2] == f"Root cause: {leaf}"
    if depth:
        path = report[report.index("Propagated up the tree:") :].splitlines()[1:]
        assert path == [f"  {i}. {e}" for i, e in enumerate(reversed(chain[:-1]), 1)]
    else:
        assert "Propagated" not in report
    assert event.to_dict()["kind"] == event.kind
    assert json.dumps(event.to_dict())  # plain data, for logs and reports
