"""Logging options of a proc mesh: its procs' lines forwarded to the client, aggregated over a
window or not, held back; log records made in actors carry the actor's identity."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import pytest
import structlog
from polling import wait_until
from taps import tapped

from mesh import Actor, endpoint, this_proc

CALL_TIMEOUT_S = 60.0
#: Long enough never to close by itself within a test: the tests flush it.
LONG_WINDOW_S = 600


class Talker(Actor):
    """Prints what it is told, and shows what its log records carry."""

    @endpoint
    def say(self, text: str, to_stderr: bool = False) -> None:
        print(text, file=sys.stderr if to_stderr else sys.stdout)

    @endpoint
    def say_with_rank(self, text: str) -> None:
        from mesh import current_rank

        print(f"{text} {current_rank().rank}")

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def root_level(self) -> int:
        return logging.getLogger().level

    @endpoint
    def logging_record(self) -> dict[str, Any]:
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logger = logging.getLogger("talker")
        logger.addHandler(handler)
        try:
            logger.warning("step done")
        finally:
            logger.removeHandler(handler)
        (record,) = records
        return {"actor_id": record.actor_id, "mesh": record.mesh_name, "rank": record.rank}  # type: ignore[attr-defined]

    @endpoint
    def structlog_event(self) -> dict[str, Any]:
        out = io.StringIO()
        logger = structlog.wrap_logger(
            structlog.PrintLogger(out),
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.JSONRenderer(),
            ],
        )
        logger.info("step done")
        event: dict[str, Any] = json.loads(out.getvalue())
        return event


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


def test_identical_lines_of_four_ranks_are_shown_once_with_their_ranks(
    make_procs: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    procs = make_procs({"gpus": 4}, name="trainers")
    talkers = procs.spawn("talkers", Talker)
    procs.logging_option(stream_to_client=True, aggregate_window_sec=LONG_WINDOW_S).get(
        timeout=CALL_TIMEOUT_S
    )
    talkers.say.call("loss 0.12").get(timeout=CALL_TIMEOUT_S)
    talkers.say.call("grad norm high", to_stderr=True).get(timeout=CALL_TIMEOUT_S)
    talkers.slice(gpus=slice(0, 2)).say.call("loss 0.12").get(timeout=CALL_TIMEOUT_S)
    procs.flush_logs().get(timeout=CALL_TIMEOUT_S)
    captured = capsys.readouterr()
    assert _lines(captured.out) == ["[4 ranks, 6 times: trainers{gpus=0..3}] loss 0.12"]
    assert _lines(captured.err) == ["[4 ranks: trainers{gpus=0..3}] grad norm high"]


def test_distinct_lines_are_not_merged(
    make_procs: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    procs = make_procs({"gpus": 4}, name="trainers")
    talkers = procs.spawn("talkers", Talker)
    procs.logging_option(aggregate_window_sec=LONG_WINDOW_S).get(timeout=CALL_TIMEOUT_S)
    talkers.slice(gpus=0).say.call("loss is low").get(timeout=CALL_TIMEOUT_S)
    talkers.slice(gpus=slice(1, 3)).say.call("two of them").get(timeout=CALL_TIMEOUT_S)
    procs.flush_logs().get(timeout=CALL_TIMEOUT_S)
    lines = _lines(capsys.readouterr().out)
    assert lines == [
        "[trainers {'gpus': 0}] loss is low",
        "[2 ranks: trainers{gpus=1..2}] two of them",
    ]


def test_lines_differing_only_in_numbers_are_shown_once_with_their_values(
    make_procs: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    procs = make_procs({"gpus": 4}, name="trainers")
    talkers = procs.spawn("talkers", Talker)
    procs.logging_option(aggregate_window_sec=LONG_WINDOW_S).get(timeout=CALL_TIMEOUT_S)
    talkers.say_with_rank.call("step 7 rank").get(timeout=CALL_TIMEOUT_S)
    procs.flush_logs().get(timeout=CALL_TIMEOUT_S)
    assert _lines(capsys.readouterr().out) == [
        "[4 ranks: trainers{gpus=0..3}] step 7 rank {0,1,2,3}"
    ]
    procs.logging_option(aggregate_window_sec=LONG_WINDOW_S, aggregate_similar=False).get(
        timeout=CALL_TIMEOUT_S
    )
    talkers.say_with_rank.call("rank").get(timeout=CALL_TIMEOUT_S)
    procs.flush_logs().get(timeout=CALL_TIMEOUT_S)
    lines = _lines(capsys.readouterr().out)
    assert sorted(lines) == [f"[trainers {{'gpus': {rank}}}] rank {rank}" for rank in range(4)]


def test_a_window_closes_by_itself(make_procs: Callable[..., Any]) -> None:
    # One rank: which window a line falls in never depends on how fast the others are.
    procs = make_procs({"gpus": 1}, name="trainers")
    talkers = procs.spawn("talkers", Talker)
    procs.logging_option(aggregate_window_sec=0.2).get(timeout=CALL_TIMEOUT_S)
    with tapped("stdout") as stdout:  # the client's loop thread prints the lines
        talkers.say.call("epoch 1").get(timeout=CALL_TIMEOUT_S)
        talkers.say.call("epoch 1").get(timeout=CALL_TIMEOUT_S)
        wait_until(lambda: _lines(stdout.text()), what="the window")
        procs.flush_logs().get(timeout=CALL_TIMEOUT_S)  # a second window, if there is one
    assert _lines(stdout.text()) in (
        ["[1 rank, 2 times: trainers{gpus=0}] epoch 1"],  # both within one window
        ["[trainers {'gpus': 0}] epoch 1"] * 2,  # the first window closed between them
    )


def test_without_aggregation_each_line_is_shown_with_its_source(
    make_procs: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    procs = make_procs({"gpus": 2}, name="trainers")
    talkers = procs.spawn("talkers", Talker)
    procs.logging_option(aggregate_window_sec=None).get(timeout=CALL_TIMEOUT_S)
    talkers.say.call("hello").get(timeout=CALL_TIMEOUT_S)
    procs.flush_logs().get(timeout=CALL_TIMEOUT_S)
    assert sorted(_lines(capsys.readouterr().out)) == [
        "[trainers {'gpus': 0}] hello",
        "[trainers {'gpus': 1}] hello",
    ]


def test_stream_to_client_false_stops_lines_at_the_client(
    make_procs: Callable[..., Any], agent_capfd: Callable[[], pytest.CaptureFixture[str]]
) -> None:
    capfd = agent_capfd()  # the agent's own output is captured too: lines go nowhere else
    procs = make_procs({"gpus": 2}, name="quiet")
    talkers = procs.spawn("talkers", Talker)
    procs.logging_option(stream_to_client=False, aggregate_window_sec=None).get(
        timeout=CALL_TIMEOUT_S
    )
    talkers.say.call("secret").get(timeout=CALL_TIMEOUT_S)
    talkers.say.call("secret on stderr", to_stderr=True).get(timeout=CALL_TIMEOUT_S)
    procs.flush_logs().get(timeout=CALL_TIMEOUT_S)
    procs.logging_option(stream_to_client=True, aggregate_window_sec=None).get(
        timeout=CALL_TIMEOUT_S
    )
    talkers.slice(gpus=0).say.call("shown").get(timeout=CALL_TIMEOUT_S)
    procs.flush_logs().get(timeout=CALL_TIMEOUT_S)
    captured = capfd.readouterr()
    assert "secret" not in captured.out + captured.err
    assert _lines(captured.out) == ["[quiet {'gpus': 0}] shown"]


def test_a_respawned_proc_keeps_forwarding(
    make_procs: Callable[..., Any], capsys: pytest.CaptureFixture[str], root_events: list[Any]
) -> None:
    procs = make_procs({"gpus": 2}, name="trainers")
    talkers = procs.spawn("talkers", Talker)
    procs.logging_option(aggregate_window_sec=LONG_WINDOW_S).get(timeout=CALL_TIMEOUT_S)
    os.kill(talkers.slice(gpus=1).pid.call_one().get(timeout=CALL_TIMEOUT_S), signal.SIGKILL)
    wait_until(lambda: root_events, what="the failure to reach the client")
    root_events.clear()
    procs.respawn([1]).get(timeout=CALL_TIMEOUT_S)
    talkers.say.call("after the restart").get(timeout=CALL_TIMEOUT_S)
    procs.flush_logs().get(timeout=CALL_TIMEOUT_S)
    lines = _lines(capsys.readouterr().out)
    assert lines == ["[2 ranks: trainers{gpus=0..1}] after the restart"]


def test_level_sets_the_procs_root_logger(make_procs: Callable[..., Any]) -> None:
    procs = make_procs({"gpus": 2})
    talkers = procs.spawn("talkers", Talker)
    procs.logging_option(level=logging.ERROR).get(timeout=CALL_TIMEOUT_S)
    assert talkers.root_level.call().get(timeout=CALL_TIMEOUT_S).values() == (logging.ERROR,) * 2


def test_log_records_of_an_actor_carry_its_identity(make_procs: Callable[..., Any]) -> None:
    procs = make_procs({"gpus": 2})
    talkers = procs.spawn("talkers", Talker)
    records = talkers.logging_record.call().get(timeout=CALL_TIMEOUT_S).values()
    events = talkers.structlog_event.call().get(timeout=CALL_TIMEOUT_S).values()
    for rank, (record, event) in enumerate(zip(records, events, strict=True)):
        assert record["mesh"] == event["mesh_name"] == "talkers"
        assert record["rank"] == event["rank"] == {"gpus": rank}
        assert record["actor_id"] == event["actor_id"]
        assert record["actor_id"].startswith("talkers-") and record["actor_id"].endswith(
            f"[{rank}]"
        )
        assert event["event"] == "step done"
    local = this_proc().spawn("local_talker", Talker)
    record = local.logging_record.call_one().get(timeout=CALL_TIMEOUT_S)
    assert record["mesh"] == "local_talker" and record["rank"] == {}
    plain = logging.getLogger("outside").makeRecord("outside", logging.INFO, "f", 1, "m", (), None)
    assert (plain.actor_id, plain.mesh_name, plain.rank) == (None, None, {})  # type: ignore[attr-defined]
    assert "actor_id" not in structlog.contextvars.get_contextvars()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"stream_to_client": "yes"}, TypeError, "stream_to_client must be True or False"),
        ({"aggregate_window_sec": 0}, ValueError, "number of seconds > 0"),
        ({"aggregate_window_sec": -1}, ValueError, "number of seconds > 0"),
        ({"aggregate_window_sec": math.nan}, ValueError, "number of seconds > 0"),
        ({"aggregate_window_sec": "3"}, ValueError, "number of seconds > 0"),
        ({"aggregate_window_sec": True}, ValueError, "number of seconds > 0"),
        ({"stream_to_client": False}, ValueError, "pass aggregate_window_sec=None"),
        ({"level": 256}, ValueError, "between 0 and 255"),
        ({"level": "INFO"}, ValueError, "between 0 and 255"),
        ({"aggregate_similar": 1}, TypeError, "aggregate_similar must be True or False"),
    ],
)
def test_bad_arguments_are_refused(
    make_procs: Callable[..., Any], kwargs: dict[str, Any], error: type, message: str
) -> None:
    procs = make_procs({"gpus": 1})
    with pytest.raises(error, match=message):
        procs.logging_option(**kwargs)


def test_only_the_owner_sets_a_meshs_output() -> None:
    with pytest.raises(ValueError, match="only be set by the process that spawned it"):
        this_proc().logging_option()
    with pytest.raises(ValueError, match="only be set by the process that spawned it"):
        this_proc().flush_logs()
