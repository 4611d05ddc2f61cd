"""The chaos harness end to end, on real processes: every fault kind against the `counters`
workload (its effect, the events the owner saw, detection and recovery), invariants that do
not hold, setup errors, and the determinism of seeded schedules.

Each run starts a fresh local allocation, so faults are grouped: one run per group of fault
kinds, shared by the tests of that group (module-scoped fixtures). After every run nothing of
it may be left: no process of its allocation or its clients, no ``meshvisor-chaos-*``
directory, no client run directory, and nothing left unclosed for the garbage collector.
"""

from __future__ import annotations

import gc
import json
import os
import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from chaos_leftovers import clean_up, nothing_left_behind, snapshot  # noqa: F401 (autouse fixture)
from chaos_workloads import HEARTBEATS

from chaos import (
    ChaosOptions,
    ChaosSetupError,
    Fault,
    FaultRecord,
    ObservedEvent,
    PlannedFault,
    RandomSchedule,
    RunReport,
    ScriptedSchedule,
    Target,
    TargetSet,
    build_parser,
    render_text,
    replay_command,
    run_chaos,
    validate_report,
)
from mesh import Settings

pytestmark = pytest.mark.timeout(120)

TESTS = Path(__file__).resolve().parent
COUNTERS = f"{TESTS / 'chaos_workloads.py'}:counters"
EXTRA = TESTS / "chaos_workloads_extra.py"
END_FILE_ENV = "MESHVISOR_CHAOS_TEST_END_FILE"  # see chaos_workloads_extra.counters_noting_the_end
#: `counters` runs two ranks per host: ranks 0, 1 on host 0 and ranks 2, 3 on host 1.
RANKS_OF_HOST = {0: {0, 1}, 1: {2, 3}}
#: The heartbeats of the `counters` procs, and the harness's agent timeout.
HEARTBEAT_TIMEOUT_S = HEARTBEATS["heartbeat_timeout_s"]
HEARTBEAT_INTERVAL_S = HEARTBEATS["heartbeat_interval_s"]
AGENT_TIMEOUT_S = ChaosOptions().agent_timeout_s
#: How often the harness's client tells its agents it is alive (the default).
OWNER_ALIVE_INTERVAL_S = Settings().owner_alive_interval_s


def extra(name: str) -> str:
    return f"{EXTRA}:{name}"


@dataclass
class Attempt:
    """What a chaos run gave: its report or the error it raised, and its `problems`: what it
    left behind (processes, directories) and what it left unclosed (ResourceWarnings)."""

    report: RunReport | None
    error: BaseException | None
    problems: list[str]


def attempt(workload: str, schedule: Any, **options: Any) -> Attempt:
    """One chaos run, then clean up after it. The live lines are printed, for failures."""
    lines: list[str] = []
    report = error = None
    problems: list[str] = []
    before = snapshot()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            try:
                report = run_chaos(
                    workload, schedule, ChaosOptions(on_update=lines.append, **options)
                )
            except Exception as exc:
                error = exc
            finally:
                gc.collect()  # what the run left unclosed is collected (and warned about) now
        problems += [
            f"{w.category.__name__}: {w.message}"
            for w in caught
            if issubclass(w.category, ResourceWarning)
        ]
    finally:
        print("\n".join(lines))
        problems += clean_up(before)
    if report is not None:
        print(render_text(report))
    return Attempt(report, error, problems)


def checked(report: RunReport | None) -> RunReport:
    """`report`, once its JSON form is valid and round-trips."""
    assert report is not None
    data = json.loads(report.to_json())
    validate_report(data)
    assert data["ok"] is report.ok
    assert RunReport.from_dict(data).to_dict() == data
    return report


def run(workload: str, schedule: Any, **options: Any) -> RunReport:
    """One chaos run that must leave nothing behind nor unclosed; raises what the run raised,
    else returns its (valid) report."""
    outcome = attempt(workload, schedule, **options)
    assert not outcome.problems, outcome.problems
    if outcome.error is not None:
        raise outcome.error
    return checked(outcome.report)


# -- looking at a report ---------------------------------------------------------------------


def record_of(report: RunReport, index: int, kind: str) -> FaultRecord:
    record = report.faults[index]
    assert record.planned.fault.kind == kind, report.faults
    return record


def events_of(report: RunReport, record: FaultRecord) -> list[ObservedEvent]:
    return [e for e in report.events if e.fault == record.index]


def assert_healthy_after(record: FaultRecord, at_least_s: float = 0.0) -> None:
    """The target answered again, after the fault's window, within the heal timeout."""
    assert record.injected_at_s is not None
    assert record.recover_s is not None, record
    assert at_least_s - 0.05 <= record.recover_s < ChaosOptions().heal_timeout_s, record


def assert_detected(record: FaultRecord) -> None:
    """Seen, then healed: 0 <= detect_s <= recover_s."""
    assert record.detect_s is not None, record
    assert record.recover_s is not None, record
    assert 0 <= record.detect_s <= record.recover_s, record


def invariant(report: RunReport, name: str) -> Any:
    found = [inv for inv in report.invariants if inv.name == name]
    assert len(found) == 1, [inv.name for inv in report.invariants]
    return found[0]


# -- kills ------------------------------------------------------------------------------------

KILLS = ScriptedSchedule(
    (
        PlannedFault(0.5, Fault.kill("SIGKILL"), Target.of_rank("counters", 0)),
        PlannedFault(0.6, Fault.kill("SIGTERM"), Target.of_rank("counters", 1)),
        PlannedFault(0.7, Fault.kill("SIGSEGV"), Target.of_rank("counters", 2)),
        PlannedFault(0.8, Fault.exit(3), Target.of_rank("counters", 3)),
        PlannedFault(0.9, Fault.kill("SIGKILL"), Target.of_rank("counters", 0)),  # again
    )
)


@pytest.fixture(scope="module")
def kills() -> RunReport:
    return run(COUNTERS, KILLS)


def test_kills_run_passes(kills: RunReport) -> None:
    assert kills.ok, render_text(kills)
    assert [r.verdict for r in kills.faults] == ["ok"] * 5
    assert kills.seed is None
    assert kills.workload_stats["clients"] == 1
    assert kills.workload_stats["steps"] > 0
    assert kills.targets == {"meshes": {"counters": 4}, "hosts": 2, "client": True, "job": False}


@pytest.mark.parametrize(
    ("index", "rank", "signame"), [(0, 0, "SIGKILL"), (1, 1, "SIGTERM"), (2, 2, "SIGSEGV")]
)
def test_kill_by_signal_is_seen_as_signal(
    kills: RunReport, index: int, rank: int, signame: str
) -> None:
    record = record_of(kills, index, "kill")
    assert record.verdict == "ok", record
    assert record.expected == ("signal",)
    assert record.observed == ["signal"]
    [event] = events_of(kills, record)
    assert (event.kind, event.mesh, event.rank) == ("signal", "counters", rank)
    assert event.host == rank // 2
    assert f"killed by {signame}" in event.message, event
    assert_detected(record)
    assert_healthy_after(record)


def test_exit_code_is_seen_as_exit(kills: RunReport) -> None:
    record = record_of(kills, 3, "kill")
    assert record.planned.fault.exit_code == 3
    assert record.verdict == "ok", record
    assert record.observed == ["exit"]
    [event] = events_of(kills, record)
    assert (event.kind, event.rank) == ("exit", 3)
    assert "exited with code 3" in event.message, event
    assert_detected(record)
    assert_healthy_after(record)


def test_a_killed_rank_is_restarted_in_a_new_process(kills: RunReport) -> None:
    """Rank 0, killed twice: the second kill found (and killed) the process that replaced the
    first, and the owner saw both."""
    first, again = record_of(kills, 0, "kill"), record_of(kills, 4, "kill")
    assert again.verdict == "ok", again
    [first_event], [second_event] = events_of(kills, first), events_of(kills, again)
    assert first_event.rank == second_event.rank == 0
    assert None not in (first_event.pid, second_event.pid)
    assert first_event.pid != second_event.pid
    assert len({e.pid for e in kills.events}) == len(kills.events) == 5


# -- pause, raise, drop, delay ----------------------------------------------------------------

LONG_PAUSE_S = 2.5  # >= heartbeat timeout + 1 s: must be seen as hung
SHORT_PAUSE_S = 0.3  # <= heartbeat timeout - 0.5 s: must go unnoticed
WINDOW_S = 0.5
SOFT = ScriptedSchedule(
    (
        PlannedFault(0.5, Fault.pause(LONG_PAUSE_S), Target.of_rank("counters", 0)),
        PlannedFault(0.6, Fault.pause(SHORT_PAUSE_S), Target.of_rank("counters", 1)),
        PlannedFault(0.7, Fault.raise_in("incr"), Target.of_rank("counters", 2)),
        PlannedFault(0.8, Fault.raise_in("incr", fatal=False), Target.of_rank("counters", 3)),
        PlannedFault(0.9, Fault.drop(0.5, WINDOW_S), Target.of_rank("counters", 0)),
        PlannedFault(1.0, Fault.delay(50.0, WINDOW_S), Target.of_rank("counters", 1)),
    )
)


@pytest.fixture(scope="module")
def soft() -> RunReport:
    return run(COUNTERS, SOFT)


def test_soft_faults_run_passes(soft: RunReport) -> None:
    assert soft.ok, render_text(soft)
    assert [r.verdict for r in soft.faults] == ["ok"] * 6


def test_long_pause_is_seen_as_hung(soft: RunReport) -> None:
    assert LONG_PAUSE_S >= HEARTBEAT_TIMEOUT_S + 1.0
    record = record_of(soft, 0, "pause")
    assert record.verdict == "ok", record
    assert record.expected == ("hung",)
    assert record.observed == ["hung"]
    [event] = events_of(soft, record)
    assert (event.kind, event.rank) == ("hung", 0)
    assert "(most recent call first):" in event.evidence  # its stacks, dumped before the kill
    assert "Evidence (the root cause of each event, trimmed)" in render_text(soft)
    # Not before the heartbeat timeout, and before the pause would have ended by itself.
    assert record.detect_s is not None
    assert record.detect_s >= HEARTBEAT_TIMEOUT_S - 2 * HEARTBEAT_INTERVAL_S, record
    assert record.detect_s < LONG_PAUSE_S + 1.0, record
    assert_detected(record)
    assert_healthy_after(record)


def test_short_pause_goes_unnoticed(soft: RunReport) -> None:
    record = record_of(soft, 1, "pause")
    assert record.verdict == "ok", record
    assert record.expected == ()
    assert record.observed == []
    assert events_of(soft, record) == []
    assert record.detect_s is None
    assert_healthy_after(record, SHORT_PAUSE_S)


def test_fatal_raise_is_seen_as_exception(soft: RunReport) -> None:
    record = record_of(soft, 2, "raise")
    assert record.verdict == "ok", record
    assert record.observed == ["exception"]
    [event] = events_of(soft, record)
    assert (event.kind, event.rank) == ("exception", 2)
    assert "'incr' raised InjectedFault: chaos: injected into incr" in event.message, event
    assert_detected(record)
    assert_healthy_after(record)


def test_non_fatal_raise_goes_unnoticed(soft: RunReport) -> None:
    record = record_of(soft, 3, "raise")
    assert not record.planned.fault.fatal
    assert record.verdict == "ok", record
    assert record.expected == ()
    assert record.observed == []
    assert record.detect_s is None
    assert_healthy_after(record)


@pytest.mark.parametrize(("index", "kind"), [(4, "drop"), (5, "delay")])
def test_drop_and_delay_go_unnoticed_and_heal(soft: RunReport, index: int, kind: str) -> None:
    record = record_of(soft, index, kind)
    assert record.verdict == "ok", record
    assert record.observed == []
    assert events_of(soft, record) == []
    assert_healthy_after(record, WINDOW_S)  # judged healthy once the window is over


# -- partition, kill_agent, kill_client -------------------------------------------------------

PARTITION_S = 3.5  # longer than the 2 s agent timeout (+ 1 s): must be seen as unreachable
HOSTS = ScriptedSchedule(
    (
        PlannedFault(0.5, Fault.partition(PARTITION_S), Target.of_host(1)),
        PlannedFault(0.6, Fault.kill_agent(), Target.of_host(0)),
        PlannedFault(0.7, Fault.kill_client(), Target.client()),
    )
)


@pytest.fixture(scope="module")
def hosts() -> RunReport:
    return run(COUNTERS, HOSTS)


def test_host_faults_run_passes(hosts: RunReport) -> None:
    assert hosts.ok, render_text(hosts)
    assert [r.verdict for r in hosts.faults] == ["ok"] * 3
    assert invariant(hosts, "every target healthy after the final heal").held


def test_partition_makes_the_ranks_of_its_host_unreachable(hosts: RunReport) -> None:
    assert PARTITION_S >= AGENT_TIMEOUT_S + 1.0
    record = record_of(hosts, 0, "partition")
    assert record.verdict == "ok", record
    assert record.expected == ("unreachable",)
    events = events_of(hosts, record)
    assert events and {e.kind for e in events} == {"unreachable"}, events
    assert {e.rank for e in events} == RANKS_OF_HOST[1]
    assert {e.host for e in events} == {1}
    assert record.detect_s is not None
    # The client last heard from the agent at most one keep-alive interval before the cut.
    assert record.detect_s >= AGENT_TIMEOUT_S - OWNER_ALIVE_INTERVAL_S - 0.1, record
    assert record.detect_s < PARTITION_S + 1.0, record
    assert_detected(record)
    assert_healthy_after(record)


def test_kill_agent_makes_its_ranks_unreachable_and_heals(hosts: RunReport) -> None:
    record = record_of(hosts, 1, "kill_agent")
    assert record.verdict == "ok", record
    events = events_of(hosts, record)
    assert events and {e.kind for e in events} == {"unreachable"}, events
    assert {e.rank for e in events} == RANKS_OF_HOST[0]
    assert_detected(record)
    # Healthy again means the ranks of host 0 answered from new procs: the agent restarted.
    assert_healthy_after(record, ChaosOptions().restart_delay_s)


def test_kill_client_starts_a_second_client_and_leaves_no_orphan(hosts: RunReport) -> None:
    record = record_of(hosts, 2, "kill_client")
    assert record.verdict == "ok", record
    assert record.observed == []
    assert_healthy_after(record, ChaosOptions().restart_delay_s)
    assert hosts.workload_stats["clients"] == 2
    assert invariant(hosts, "no orphan process").held
    assert invariant(hosts, "the client never failed").held
    # The second client carried on the work of the first.
    assert invariant(hosts, "the workload made progress").held


# -- invariants that do not hold --------------------------------------------------------------

ONE_KILL = ScriptedSchedule(
    (PlannedFault(0.5, Fault.kill("SIGKILL"), Target.of_rank("counters", 1)),)
)


def test_without_restart_policy_a_kill_crashes_the_client() -> None:
    report = run(extra("no_restart_crash"), ONE_KILL, heal_timeout_s=5.0)
    assert not report.ok
    [record] = report.faults
    assert record.observed == ["signal"]  # seen, but never healed
    assert record.verdict == "not_healed", record
    assert record.recover_s is None
    crashed = invariant(report, "the client never failed")
    assert not crashed.held
    assert "SupervisionError" in crashed.detail and "SIGKILL" in crashed.detail, crashed
    assert not invariant(report, "every fault observed as expected and healed").held
    assert not invariant(report, "every target healthy after the final heal").held
    # The crashed client still cleaned up after itself.
    assert invariant(report, "no orphan process").held


def test_an_unhandled_failure_is_raised_once_in_the_client() -> None:
    report = run(extra("fail_fast_raises"), ONE_KILL, heal_timeout_s=1.0, hosts=1)
    [record] = report.faults
    assert record.observed == ["signal"]
    raised = invariant(report, "one failure is raised once in the main thread")
    assert raised.held, raised.detail


def test_without_restart_policy_a_killed_rank_is_not_healed() -> None:
    report = run(extra("no_restart_tolerant"), ONE_KILL, heal_timeout_s=1.5)
    assert not report.ok
    [record] = report.faults
    assert record.observed == ["signal"]
    assert record.verdict == "not_healed", record
    assert "did not become healthy" in record.note, record
    assert record.recover_s is None
    observed = invariant(report, "every fault observed as expected and healed")
    assert not observed.held and "not_healed" in observed.detail, observed
    assert not invariant(report, "every target healthy after the final heal").held
    # The client handled the failure: it did not fail, only the job did not heal.
    assert invariant(report, "the client never failed").held
    failed = {inv.name for inv in report.failed_invariants()}
    assert failed == {
        "every fault observed as expected and healed",
        "every target healthy after the final heal",
    }


def test_user_invariants_that_return_a_reason_or_raise_do_not_hold() -> None:
    from chaos_workloads_extra import AUDIT_ERROR, LEDGER_DETAIL

    report = run(extra("broken_invariants"), ScriptedSchedule(()))
    assert not report.ok
    ledger = invariant(report, "the ledger balances")
    assert (ledger.held, ledger.detail, ledger.builtin) == (False, LEDGER_DETAIL, False)
    audit = invariant(report, "the audit passes")
    assert not audit.held
    assert audit.detail == f"raised ValueError: {AUDIT_ERROR}"
    flag = invariant(report, "the flag is set")
    assert (flag.held, flag.detail) == (False, "returned False")
    assert invariant(report, "the workload made progress").held
    assert {inv.name for inv in report.failed_invariants()} == {
        "the ledger balances",
        "the audit passes",
        "the flag is set",
    }
    assert "FAILED: 3 invariants did not hold" in render_text(report)


def test_a_client_without_progress_counts_as_hung() -> None:
    from chaos_workloads_extra import STALL_S

    schedule = ScriptedSchedule(
        (PlannedFault(1.0, Fault.drop(0.3, 0.5), Target.of_rank("counters", 0)),)
    )
    report = run(extra("stalls"), schedule, client_hang_s=1.0)
    assert not report.ok
    hung = invariant(report, "the client never hung")
    assert not hung.held
    assert "limit 1 s" in hung.detail, hung
    assert report.workload_stats["max_step_gap_s"] >= STALL_S - 0.1
    assert [inv.name for inv in report.failed_invariants()] == ["the client never hung"]


# -- setup errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        (f"{TESTS / 'no_such_workloads.py'}:counters", "no_such_workloads.py does not exist"),
        (extra("no_such_function"), "has no function 'no_such_function'"),
        (extra("no_target"), "must register a target"),
    ],
    ids=["missing-file", "missing-function", "no-target"],
)
def test_setup_errors(workload: str, message: str) -> None:
    with pytest.raises(ChaosSetupError) as caught:
        run(workload, ScriptedSchedule(()))
    text = str(caught.value)
    assert workload in text
    assert message in text


@pytest.fixture(scope="module")
def missing_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Attempt, Path]:
    """A scripted fault aimed at a rank the workload does not have: the attempt, and the file
    the workload writes when it ends normally (told by the harness that the run is over)."""
    end_file = tmp_path_factory.mktemp("end") / "ended"
    schedule = ScriptedSchedule((PlannedFault(0.5, Fault.kill(), Target.of_rank("counters", 9)),))
    os.environ[END_FILE_ENV] = str(end_file)  # the client inherits the environment
    try:
        outcome = attempt(extra("counters_noting_the_end"), schedule, heal_timeout_s=3.0)
    finally:
        del os.environ[END_FILE_ENV]
    return outcome, end_file


def test_a_fault_aimed_at_a_missing_target_is_refused(
    missing_target: tuple[Attempt, Path],
) -> None:
    outcome, _ = missing_target
    assert outcome.report is None
    assert isinstance(outcome.error, ChaosSetupError), outcome.error
    assert "rank 9 of mesh 'counters', which does not exist" in str(outcome.error)
    assert "ranks 0-3 of mesh 'counters'" in str(outcome.error)  # and what the targets are


def test_a_refused_schedule_lets_the_workload_end_normally(
    missing_target: tuple[Attempt, Path],
) -> None:
    outcome, end_file = missing_target
    assert outcome.problems == []
    assert end_file.exists()


# -- determinism ------------------------------------------------------------------------------

SEED = 11


def seeded() -> RandomSchedule:
    return RandomSchedule.from_mix(SEED, 1.0, 4.0, "kill,pause", max_concurrent=2)


def test_same_seed_same_faults_on_the_same_targets_in_the_same_order() -> None:
    reports = [run(COUNTERS, seeded()) for _ in range(2)]
    plans = [
        [(r.planned.fault.kind, r.planned.target, r.planned.at_s) for r in report.faults]
        for report in reports
    ]
    assert plans[0], "the schedule injected no fault: the comparison would prove nothing"
    assert plans[0] == plans[1]
    # The fault parameters too (which signal, how long a pause), and what the plan says.
    assert [r.planned for r in reports[0].faults] == [r.planned for r in reports[1].faults]
    assert [r.planned.fault for r in reports[0].faults] == [
        r.planned.fault for r in reports[1].faults
    ]
    targets = TargetSet(tuple(reports[0].targets["meshes"].items()), reports[0].targets["hosts"])
    assert [r.planned.fault for r in reports[0].faults] == [p.fault for p in seeded().plan(targets)]
    for report in reports:
        assert report.ok, render_text(report)
        assert report.seed == SEED
        assert report.schedule["seed"] == SEED
        assert [r.index for r in report.faults] == list(range(len(report.faults)))
        injected = [r.injected_at_s for r in report.faults]
        assert None not in injected and injected == sorted(injected)
        assert "--seed 11" in report.replay
        assert f"--seed {SEED}" in render_text(report)


def test_replay_command_rebuilds_the_schedule() -> None:
    """The report's replay command, parsed by the CLI, gives back the same schedule (no run
    needed: the harness builds the command from the schedule and the options)."""
    replay = replay_command(COUNTERS, seeded(), ChaosOptions())
    words = shlex.split(replay)
    assert words[:3] == ["meshvisor", "chaos", "run"]
    args = build_parser().parse_args(words[2:])
    assert args.script == COUNTERS
    rebuilt = RandomSchedule.from_mix(
        args.seed,
        args.mtbf,
        args.duration,
        args.faults,
        warmup_s=args.warmup,
        max_concurrent=args.max_concurrent,
    )
    assert rebuilt == seeded()
    assert args.hosts == ChaosOptions().hosts
