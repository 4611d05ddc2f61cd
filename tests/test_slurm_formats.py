"""SLURM's own formats, read by `job`'s parsers: durations, host lists, ``scontrol show -o``
records and node states, checked for all inputs (hypothesis) and against what the private
cluster's real SLURM prints (``scontrol show hostnames``, TimeLimit, nodes set DOWN/DRAIN)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from polling import wait_until

from job import SlurmFormatError
from job.formats import (
    expand_hostlist,
    format_duration,
    parse_duration,
    parse_key_values,
    parse_node_state,
    parse_records,
    pending_reason,
)

pytestmark = pytest.mark.timeout(300)

T = 60.0
REAL = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# -- durations -------------------------------------------------------------------------------


@given(st.floats(min_value=0, max_value=400 * 86400, allow_nan=False))
@example(0.0)
@example(59.2)
@example(86400.0)
def test_a_formatted_duration_parses_back_to_the_same_whole_seconds(seconds: float) -> None:
    text = format_duration(seconds)
    days, _, clock = text.partition("-")
    assert days.isdigit() and len(clock) == 8, text  # D-HH:MM:SS, as --time takes it
    assert parse_duration(text) == math.ceil(seconds)


@st.composite
def duration_texts(draw: st.DrawFn) -> tuple[str, int]:
    """Every form SLURM prints or takes, with the seconds it means."""
    d = draw(st.integers(0, 400))
    h, m, s = draw(st.integers(0, 23)), draw(st.integers(0, 59)), draw(st.integers(0, 59))
    pad = draw(st.sampled_from([2, 1]))  # SLURM pads to two digits; people may not

    def two(n: int) -> str:
        return f"{n:0{pad}d}"

    form = draw(st.sampled_from(["D-HH:MM:SS", "D-HH:MM", "D-HH", "HH:MM:SS", "MM:SS", "M"]))
    return {
        "D-HH:MM:SS": (f"{d}-{two(h)}:{two(m)}:{two(s)}", ((d * 24 + h) * 60 + m) * 60 + s),
        "D-HH:MM": (f"{d}-{two(h)}:{two(m)}", ((d * 24 + h) * 60 + m) * 60),
        "D-HH": (f"{d}-{two(h)}", (d * 24 + h) * 3600),
        "HH:MM:SS": (f"{d * 24 + h}:{two(m)}:{two(s)}", ((d * 24 + h) * 60 + m) * 60 + s),
        "MM:SS": (f"{m + 60 * h}:{two(s)}", (m + 60 * h) * 60 + s),
        "M": (f"{m + 60 * h}", (m + 60 * h) * 60),
    }[form]


@given(duration_texts())
def test_every_form_of_a_slurm_duration_parses_to_its_seconds(case: tuple[str, int]) -> None:
    text, seconds = case
    assert parse_duration(text) == seconds
    assert parse_duration(f" {text}\n") == seconds  # as a command prints it


@pytest.mark.parametrize("word", ["UNLIMITED", "INFINITE", "NOT_SET", "INVALID", "N/A", "", "none"])
def test_slurms_words_for_no_limit_parse_to_none(word: str) -> None:
    assert parse_duration(word) is None


@pytest.mark.parametrize("text", ["soon", "1-", "-5", "1:2:3:4", "1-2:3:4:5", "1.5", "1-x", "::"])
def test_what_is_not_a_duration_is_a_format_error_quoting_it(text: str) -> None:
    with pytest.raises(SlurmFormatError, match="not a SLURM duration"):
        parse_duration(text)


@pytest.fixture
def held_job(slurm_cluster: Any, tmp_path: Path) -> Iterator[str]:
    """A job held in the queue (it never runs), whose time limit a test can change."""
    out = slurm_cluster.run(
        ["sbatch", "--parsable", "--hold", f"--output={tmp_path}/out", "--wrap", "true"]
    ).stdout
    job_id = out.strip().split(";")[0]
    try:
        yield job_id
    finally:
        slurm_cluster.run(["scancel", job_id], check=False)


@REAL
@given(minutes=st.integers(1, 60 * 24 * 365))  # squeue prints INVALID beyond a year
@example(minutes=1)
@example(minutes=60)
@example(minutes=24 * 60)
def test_slurm_takes_a_formatted_time_limit_and_prints_one_that_parses_back(
    slurm_cluster: Any, held_job: str, minutes: int
) -> None:
    limit = format_duration(minutes * 60)
    slurm_cluster.run(["scontrol", "update", f"JobId={held_job}", f"TimeLimit={limit}"])
    record = parse_records(slurm_cluster.run(["scontrol", "show", "job", "-o", held_job]).stdout)
    assert parse_duration(record[0]["TimeLimit"]) == minutes * 60
    squeue = slurm_cluster.run(["squeue", "-h", "-j", held_job, "-o", "%l"]).stdout
    assert parse_duration(squeue) == minutes * 60


# -- host lists --------------------------------------------------------------------------------


@st.composite
def host_lists(draw: st.DrawFn) -> str:
    """Host lists as SLURM writes them: several groups, zero-padded ranges, several bracket
    sections in one name (``pre[1-2]mid[01-03]``)."""
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        name = ""
        for _ in range(draw(st.integers(0, 2))):
            name += draw(st.from_regex(r"[a-z]{1,3}(-[a-z]{1,2})?", fullmatch=True))
            ranges = []
            for _ in range(draw(st.integers(1, 3))):  # in any order, even repeated
                width = draw(st.integers(1, 3))
                low = draw(st.integers(0, 10**width - 1))
                high = draw(st.integers(low, low + 4))
                high_width = draw(st.sampled_from([width, len(str(high))]))  # n[8-10], n[08-10]
                ranges.append(
                    f"{low:0{width}d}-{high:0{high_width}d}" if high > low else f"{low:0{width}d}"
                )
            name += "[" + ",".join(ranges) + "]"
        groups.append(name or draw(st.from_regex(r"[a-z]{1,4}[0-9]{0,3}", fullmatch=True)))
    return ",".join(groups)


@REAL
@given(host_lists())
@example("n[1-3]")
@example("gpu[09-11],n[1,3,5]")
@example("x[1-2]y[3-4]")
@example("pre[1-2]suf[01-02]")
@example("a,b,c[1-2]")
@example("n[001-003,10]")
def test_a_host_list_expands_as_scontrol_show_hostnames_does(
    slurm_cluster: Any, hostlist: str
) -> None:
    real = slurm_cluster.run(["scontrol", "show", "hostnames", hostlist]).stdout.split()
    assert expand_hostlist(hostlist) == real


@pytest.mark.parametrize("hostlist", ["n[3-1]", "n[]", "n[1-2", "n[a-b]", "n]1["])
def test_a_malformed_host_list_is_a_format_error(hostlist: str) -> None:
    with pytest.raises(SlurmFormatError, match="not a SLURM host list"):
        expand_hostlist(hostlist)


def test_text_after_the_last_bracket_is_kept_though_this_slurm_refuses_it(
    slurm_cluster: Any,
) -> None:
    refused = slurm_cluster.run(["scontrol", "show", "hostnames", "n[1-2]-ib"], check=False)
    assert "Invalid hostlist" in refused.stdout + refused.stderr  # SLURM 22.05
    assert expand_hostlist("n[1-2]-ib") == ["n1-ib", "n2-ib"]  # what later SLURMs mean by it


# -- scontrol's records --------------------------------------------------------------------------


@given(
    st.lists(
        st.tuples(
            st.from_regex(r"[A-Z][A-Za-z0-9_]{0,8}(/[A-Z][a-z]{1,4}|:[A-Z])?", fullmatch=True),
            st.from_regex(r"([a-z0-9=.,/@*()\[\]-]+( [a-z0-9=.,/-]+)*)?", fullmatch=True),
        ),
        min_size=1,
        max_size=8,
        unique_by=lambda kv: kv[0],
    )
)
def test_a_record_of_key_values_parses_back_whatever_its_values_hold(
    pairs: list[tuple[str, str]],
) -> None:
    line = " ".join(f"{key}={value}" for key, value in pairs)
    expected = {key: "" if value == "(null)" else value for key, value in pairs}
    assert parse_key_values(line) == expected


def test_scontrols_real_job_and_node_records_parse_with_spaces_and_equals_in_values(
    slurm: Any, tmp_path: Path
) -> None:
    where = tmp_path / "dir with space"
    where.mkdir()
    script = where / "the job.sh"
    script.write_text("#!/bin/sh\nsleep 100\n")
    script.chmod(0o755)
    comment = "retry after fix, see ticket=42 (owner: ops)"
    job_id = slurm.run(
        [
            "sbatch",
            "--parsable",
            "--job-name=has space",
            f"--comment={comment}",
            "--nodelist=n2",
            "--time=1-02:03",
            f"--output={where}/out %j.txt",
            str(script),
        ]
    ).stdout.strip()
    wait_until(
        lambda: (
            parse_records(slurm.run(["scontrol", "show", "job", "-o", job_id]).stdout)[0][
                "JobState"
            ]
            == "RUNNING"
        ),
        T,
        "the job to run",
    )
    reason = "disk check = pending, see ticket 7"
    slurm.run(["scontrol", "update", "NodeName=n1", "State=DRAIN", f"Reason={reason}"])

    job = parse_records(slurm.run(["scontrol", "show", "job", "-o", job_id]).stdout)[0]
    assert job["JobId"] == job_id and job["JobName"] == "has space"
    assert job["Command"] == str(script) and job["WorkDir"]
    assert job["Comment"] == comment
    assert job["StdOut"] == f"{where}/out {job_id}.txt"
    assert job["NodeList"] == "n2" and job["BatchHost"] == "n2"
    assert job["CPUs/Task"] == "1" and job["ReqB:S:C:T"] and job["AllocNode:Sid"]
    assert job["Account"] == "" and job["Dependency"] == ""  # (null)
    assert parse_duration(job["TimeLimit"]) == (26 * 60 + 3) * 60

    node = parse_records(slurm.run(["scontrol", "show", "node", "-o", "n1"]).stdout)[0]
    assert node["NodeName"] == "n1" and node["NodeAddr"] == "127.0.0.1"
    assert node["OS"].startswith("Linux ") and " " in node["OS"]
    assert pending_reason(node) == reason and node["Reason"].startswith(reason + " [")
    assert "DRAIN" in parse_node_state(node["State"]).flags
    every = parse_records(slurm.run(["scontrol", "show", "node", "-o"]).stdout)
    assert [record["NodeName"] for record in every] == ["n1", "n2", "n3", "n4"]
    keys = set(node)
    assert all(set(record) - {"Reason"} <= keys for record in every)  # the same keys each


# -- node states -------------------------------------------------------------------------------


def test_node_states_read_the_same_from_sinfo_short_and_long_and_scontrol(
    slurm: Any, tmp_path: Path
) -> None:
    job_id = slurm.run(
        ["sbatch", "--parsable", "--nodelist=n3", f"--output={tmp_path}/out", "--wrap", "sleep 100"]
    ).stdout.strip()
    wait_until(lambda: squeue_state(slurm, job_id) == "RUNNING", T, "the job to run on n3")
    slurm.kill_slurmd("n4")  # SLURM sees it stop answering after SlurmdTimeout
    wait_until(lambda: sinfo(slurm, "%t")["n4"].endswith("*"), T, "n4 to be not responding")
    slurm.run(["scontrol", "update", "NodeName=n1", "State=DRAIN", "Reason=drained by a test"])
    slurm.run(["scontrol", "update", "NodeName=n3", "State=DRAIN", "Reason=draining by a test"])
    seen: dict[str, Any] = {}

    def n2_seen_down() -> bool:
        """Set n2 DOWN and read every source; its slurmd, still up, brings it back at its next
        registration (ReturnToService=2), so read again until all saw it down."""
        slurm.run(["scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=down by a test"])
        seen.update(short=sinfo(slurm, "%t"), long=sinfo(slurm, "%T"), reasons=sinfo(slurm, "%E"))
        seen["records"] = {
            record["NodeName"]: record
            for record in parse_records(slurm.run(["scontrol", "show", "node", "-o"]).stdout)
        }
        states = [seen["short"]["n2"], seen["long"]["n2"], seen["records"]["n2"]["State"]]
        return all(state.lower().startswith("down") for state in states)

    wait_until(n2_seen_down, T, "every source to see n2 down at once")
    short, long, reasons, records = seen["short"], seen["long"], seen["reasons"], seen["records"]
    for node in ("n1", "n2", "n3", "n4"):
        seen = [short[node], long[node], records[node]["State"]]
        states = [parse_node_state(text) for text in seen]
        for state in states:
            assert not state.usable, seen
        for flag in ("DRAIN", "NOT_RESPONDING"):
            assert len({flag in state.flags for state in states}) == 1, (flag, seen)
        assert len({state.base == "DOWN" for state in states}) == 1, seen
    assert "DRAIN" in parse_node_state(short["n1"]).flags
    assert parse_node_state(long["n1"]).base == "IDLE"
    assert parse_node_state(short["n2"]).base == "DOWN"
    assert parse_node_state(records["n3"]["State"]).base in ("ALLOCATED", "MIXED")
    assert "DRAIN" in parse_node_state(long["n3"]).flags
    assert "NOT_RESPONDING" in parse_node_state(records["n4"]["State"]).flags
    assert pending_reason(records["n1"]) == reasons["n1"] == "drained by a test"
    assert pending_reason(records["n2"]) == reasons["n2"] == "down by a test"
    assert pending_reason(records["n3"]) == "draining by a test"
    job = parse_records(slurm.run(["scontrol", "show", "job", "-o", job_id]).stdout)[0]
    assert expand_hostlist(job["NodeList"]) == ["n3"]


def squeue_state(slurm: Any, job_id: str) -> str:
    return str(slurm.run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False).stdout.strip())


def sinfo(slurm: Any, field: str) -> dict[str, str]:
    """One sinfo field per node (``sinfo -N -o '%N|FIELD'``)."""
    out = slurm.run(["sinfo", "-h", "-N", "-o", f"%N|{field}"]).stdout
    return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)
