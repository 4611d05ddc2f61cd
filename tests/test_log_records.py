"""Per-rank log files without processes: the records, their levels, rotation by size, and
reading them back merged and filtered (`meshvisor logs`'s parsing of its options)."""

from __future__ import annotations

import json
import os
import re
import stat
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.testing import Aggregator, LogFileConfig, RankedLine, RankLog, line_level
from observe import LogFilter, LogsError, read_logs

PROC = {"proc_id": "trainers-abc123-5", "mesh_name": "trainers", "labels": ["hosts", "gpus"]}
PROC |= {"sizes": [2, 4], "rank": 5}


@pytest.mark.parametrize(
    ("text", "stream", "level"),
    [
        ("loss 0.12", 1, "info"),
        ("Traceback (most recent call last):", 2, "error"),
        ("WARNING:root:disk almost full", 2, "warning"),
        ("2026-05-01 10:00:00,123 ERROR trainer: step failed", 2, "error"),
        ("2026-05-01T10:00:00.5Z [debug    ] step_started", 1, "debug"),
        ("[critical] out of memory", 1, "critical"),
        ('{"event": "step", "level": "warning"}', 1, "warning"),
        ('{"event": "step", "level": "chatty"}', 1, "info"),
        ("an ERROR later in the line", 1, "info"),
        ("error: lower case without brackets is a print", 1, "info"),
        ("INFORMATION is not a level", 2, "error"),
    ],
)
def test_the_level_of_a_line(text: str, stream: int, level: str) -> None:
    assert line_level(text, stream) == level


def _kept_texts(directory: Path) -> list[str]:
    """The texts in the kept files of `directory` (one proc's), oldest first."""
    return [record["text"] for record in read_logs(directory)]


def test_a_record_says_where_the_line_came_from(tmp_path: Path) -> None:
    log = RankLog(LogFileConfig(str(tmp_path)), PROC, 4242, "node7")
    log.write(2, [b"WARNING:root:hot", "caf\u00e9".encode(), b"\xff bad"])
    log.close()
    lines = (tmp_path / "trainers-abc123-5.log").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records[0] | {"t": 0} == {
        "t": 0,
        "mesh": "trainers",
        "rank": 5,
        "point": {"hosts": 1, "gpus": 1},
        "proc": "trainers-abc123-5",
        "pid": 4242,
        "host": "node7",
        "stream": "stderr",
        "level": "warning",
        "text": "WARNING:root:hot",
    }
    assert [r["text"] for r in records[1:]] == ["caf\u00e9", "\ufffd bad"]
    assert stat.S_IMODE(os.stat(tmp_path / "trainers-abc123-5.log").st_mode) == 0o600


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=20), max_size=30),
    max_files=st.integers(1, 4),
)
def test_rotation_keeps_at_most_the_files_asked_and_loses_nothing_inside_them(
    tmp_path_factory: pytest.TempPathFactory, batches: list[list[int]], max_files: int
) -> None:
    directory = tmp_path_factory.mktemp("rotation")
    log = RankLog(LogFileConfig(str(directory), 1024, max_files), PROC, 1, "h")
    printed = []
    for batch in batches:
        lines = [f"{len(printed) + i}:" + "x" * width for i, width in enumerate(batch)]
        printed += lines
        log.write(1, [line.encode() for line in lines])
    log.close()
    files = sorted(directory.glob("trainers-abc123-5.log*"))
    assert len(files) <= max_files
    for path in files:  # a file outgrows the limit only by holding a single record
        content = path.read_bytes()
        assert len(content) <= 1024 or content.count(b"\n") == 1
    kept = _kept_texts(directory)
    assert kept == printed[len(printed) - len(kept) :]  # the newest lines, none missing
    if printed:
        assert kept, "the last line written is always kept"


def test_records_of_all_ranks_are_merged_in_time_order_and_filtered(tmp_path: Path) -> None:
    logs = [
        RankLog(LogFileConfig(str(tmp_path)), PROC | {"proc_id": f"p-{r}", "rank": r}, r, "h")
        for r in range(3)
    ]
    for step in range(4):
        for rank, log in enumerate(logs):
            log.write(1 + (step == 3), [f"step {step} rank {rank}".encode()])
    for log in logs:
        log.close()
    texts = [record["text"] for record in read_logs(tmp_path)]
    assert texts == [f"step {s} rank {r}" for s in range(4) for r in range(3)]
    only = LogFilter.from_options(ranks=["1", "hosts=0,gpus=2"], level="ERROR")
    assert [r["text"] for r in read_logs(tmp_path, only)] == [
        "step 3 rank 1",
        "step 3 rank 2",
    ]


def test_filter_options_are_checked() -> None:
    ranks = LogFilter.from_options(ranks=["3", "hosts=0, gpus=1"]).ranks
    assert ranks == (3, {"hosts": 0, "gpus": 1})
    with pytest.raises(LogsError, match="--rank 'gpus=one' is not a rank"):
        LogFilter.from_options(ranks=["gpus=one"])
    with pytest.raises(LogsError, match="is not a rank"):
        LogFilter.from_options(ranks=["\u00b2"])  # a digit to str.isdigit, not to int()
    with pytest.raises(LogsError, match="--level 'loud' is not a level"):
        LogFilter.from_options(level="loud")
    before = time.time()
    since = LogFilter.from_options(since="10m").since
    assert since is not None and before - 600 <= since <= time.time() - 600
    until = LogFilter.from_options(until="2026-05-01T10:00:00+00:00").until
    assert until == datetime(2026, 5, 1, 10, tzinfo=timezone.utc).timestamp()
    with pytest.raises(LogsError, match="--until '5 parsecs' is neither a duration"):
        LogFilter.from_options(until="5 parsecs")
    for bad in ("-5m", "nanm", "infh"):
        with pytest.raises(LogsError, match="neither"):
            LogFilter.from_options(since=bad)
    with pytest.raises(LogsError, match="not found"):
        list(read_logs("/nonexistent/logs"))


def test_bad_rotation_settings_name_the_variable() -> None:
    with pytest.raises(ValueError, match="MESHVISOR_LOG_FILE_BYTES='big' must be an integer"):
        LogFileConfig.from_env("/x", {"MESHVISOR_LOG_FILE_BYTES": "big"})
    with pytest.raises(ValueError, match="at least 1024 bytes"):
        LogFileConfig.from_env("/x", {"MESHVISOR_LOG_FILE_BYTES": "10"})
    assert LogFileConfig.from_env("/x", {"MESHVISOR_LOG_FILES": "0"}).max_files == 0


@settings(max_examples=100, deadline=None)
@given(
    words=st.lists(st.sampled_from(["loss", "step", "x", " ", "/", "="]), min_size=1, max_size=4),
    rows=st.lists(st.lists(st.integers(0, 10**6), min_size=4, max_size=4), min_size=1, max_size=12),
    similar=st.booleans(),
)
def test_similar_lines_are_one_line_whose_numbers_cover_every_rank(
    words: list[str], rows: list[list[int]], similar: bool
) -> None:
    def text(numbers: list[int]) -> str:
        return "".join(f"{word}{number}" for word, number in zip(words, numbers))

    aggregator = Aggregator(similar)
    for rank, numbers in enumerate(rows):
        aggregator.add(RankedLine(1, text(numbers), f"m {{'r': {rank}}}", (("r", rank),)))
    shown = [line for _, line in aggregator.take()]
    assert len(shown) == (1 if similar else len({text(numbers) for numbers in rows}))
    if similar:
        slots = re.findall(r"\{([\d.,]+)\}|(\d+)", shown[0].split("] ", 1)[1])
        for index, (values, plain) in enumerate(slots):
            column = [numbers[index] for numbers in rows]
            if plain:
                assert set(column) == {int(plain)}
            elif ".." in values:
                low, high = values.split("..")
                assert (min(column), max(column)) == (int(low), int(high))
            else:
                assert sorted(set(column)) == [int(value) for value in values.split(",")]
