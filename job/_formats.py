"""What SLURM's commands print, read robustly across versions.

``scontrol show job|node -o`` prints one record per line as ``Key=value`` pairs separated by
spaces, where a few values hold spaces themselves (``Reason=Not responding [slurm@...]``,
``Comment=...``); ``sbatch --parsable`` prints ``ID`` or ``ID;CLUSTER``; squeue's ``%L`` and
``%l`` print durations as ``[D-]HH:MM:SS``, ``MM:SS`` or words (``UNLIMITED``, ``NOT_SET``);
node states carry suffix flags (``down*``, ``idle~``, ``MIXED+DRAIN``). Every function here is
pure, so the property tests cover them for all inputs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: A key of scontrol's ``Key=value`` output: a capitalised word, possibly with ``_``, ``:`` or
#: ``/`` (``TRES``, ``CPUs/Task``, ``MCS_label``, ``Socks/Node``, ``ReqB:S:C:T``). SLURM's keys
#: all start with a capital, which tells them from ``word=`` in a free-text value.
_KEY = re.compile(r"(?:^|(?<=\s))([A-Z][A-Za-z0-9_:/]*)=")

#: What SLURM appends to a node's Reason: who set it and when (``[root@2024-01-01T10:00:00]``).
_REASON_STAMP = re.compile(r"\s*\[[^\[\]@]*@[0-9T:-]+\]$")

#: Job states in which it still holds nodes or waits for them.
LIVE_JOB_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}
)

#: Job states in which it will not run (any more): its agents will never come up.
FINISHED_JOB_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)

#: Reasons a pending job gives when it can never start as submitted (SLURM keeps it queued).
HOPELESS_PENDING_REASONS = frozenset(
    {
        "AccountNotAllowed",
        "BadConstraints",
        "InvalidAccount",
        "InvalidQOS",
        "PartitionConfig",
        "PartitionDown",
        "PartitionInactive",
        "PartitionNodeLimit",
        "PartitionTimeLimit",
        "QOSJobLimit",
        "ReqNodeNotAvail",
    }
)


class SlurmFormatError(ValueError):
    """SLURM printed something this version of meshvisor cannot read."""


def parse_key_values(line: str) -> dict[str, str]:
    """The ``Key=value`` pairs of one ``scontrol show ... -o`` record. A value runs up to the
    next `` Key=`` (a capitalised word not seen yet in the record: SLURM prints each key once),
    so values with spaces or ``=`` stay whole; ``(null)`` becomes the empty string."""
    matches = []
    seen = set()
    for match in _KEY.finditer(line):
        if match.group(1) not in seen:
            seen.add(match.group(1))
            matches.append(match)
    fields = {}
    for match, following in zip(matches, [*matches[1:], None], strict=True):
        end = following.start() if following is not None else len(line)
        value = line[match.end() : end].strip()
        fields[match.group(1)] = "" if value == "(null)" else value
    return fields


def parse_records(text: str) -> list[dict[str, str]]:
    """Every record of ``scontrol show ... -o`` output (one per non-empty line)."""
    return [parse_key_values(line) for line in text.splitlines() if "=" in line]


def parse_job_id(sbatch_output: str) -> str:
    """The job id in what ``sbatch --parsable`` printed (``ID`` or ``ID;CLUSTER``)."""
    for line in reversed(sbatch_output.strip().splitlines()):
        job_id = line.strip().split(";", 1)[0]
        if job_id.isdigit():
            return job_id
    raise SlurmFormatError(f"sbatch printed no job id: {sbatch_output.strip()[:200]!r}")


def parse_duration(text: str) -> float | None:
    """Seconds in a SLURM duration: ``[D-]HH:MM:SS``, ``HH:MM:SS``, ``MM:SS``, ``M`` (minutes,
    as ``--time`` takes it) or ``D-HH[:MM]``; None for ``UNLIMITED``, ``INFINITE``,
    ``NOT_SET``, ``INVALID``, ``N/A`` and the empty string."""
    text = text.strip()
    if text.upper() in ("", "UNLIMITED", "INFINITE", "NOT_SET", "INVALID", "N/A", "NONE"):
        return None
    days = 0
    if "-" in text:
        day_text, _, text = text.partition("-")
        if not day_text.isdigit():
            raise SlurmFormatError(f"not a SLURM duration: {day_text}-{text!r}")
        days = int(day_text)
        parts = text.split(":")
        if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
            raise SlurmFormatError(f"not a SLURM duration: {days}-{text!r}")
        parts += ["0"] * (3 - len(parts))  # D-HH, D-HH:MM
        hours, minutes, seconds = (int(p) for p in parts)
    else:
        parts = text.split(":")
        if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
            raise SlurmFormatError(f"not a SLURM duration: {text!r}")
        numbers = [int(p) for p in parts]
        if len(numbers) == 1:  # minutes
            hours, minutes, seconds = 0, numbers[0], 0
        elif len(numbers) == 2:  # MM:SS
            hours, minutes, seconds = 0, numbers[0], numbers[1]
        else:
            hours, minutes, seconds = numbers
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def format_duration(seconds: float) -> str:
    """A duration as SLURM's ``--time`` takes it: ``D-HH:MM:SS`` (rounded up to a second)."""
    if seconds < 0:
        raise ValueError(f"a duration cannot be negative ({seconds})")
    total = int(-(-seconds // 1))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"


@dataclass(frozen=True)
class NodeState:
    """A node state as SLURM prints it, split into its base state and its flags."""

    base: str  # e.g. IDLE, ALLOCATED, MIXED, DOWN
    flags: frozenset[str]  # e.g. DRAIN, NOT_RESPONDING, POWERED_DOWN, COMPLETING

    @property
    def usable(self) -> bool:
        """Whether jobs can run there now."""
        bad = {"DRAIN", "NOT_RESPONDING", "POWERED_DOWN", "FAIL", "MAINTENANCE", "PLANNED"}
        return self.base not in ("DOWN", "FUTURE", "UNKNOWN", "INVALID") and not self.flags & bad


#: sinfo's one-character suffixes (``%t``) and what they mean.
_SUFFIX_FLAGS = {
    "*": "NOT_RESPONDING",
    "~": "POWERED_DOWN",
    "#": "POWERING_UP",
    "!": "POWERING_DOWN",
    "%": "POWERING_DOWN",
    "$": "MAINTENANCE",
    "@": "REBOOT_REQUESTED",
    "^": "REBOOT_ISSUED",
    "-": "PLANNED",
}

#: sinfo's state names, short (``%t``) and long (``%T``), as base state and flags, where they
#: differ from scontrol's (``drain`` is an idle node with the DRAIN flag).
_SINFO_STATES: dict[str, tuple[str, frozenset[str]]] = {
    name: (base, frozenset(flags.split()))
    for names, base, flags in (
        ("alloc allocated", "ALLOCATED", ""),
        ("comp completing", "COMPLETING", "COMPLETING"),
        ("drain drained", "IDLE", "DRAIN"),
        ("drng draining", "ALLOCATED", "DRAIN"),
        ("fail", "DOWN", "FAIL"),
        ("failg failing", "ALLOCATED", "FAIL"),
        ("futr", "FUTURE", ""),
        ("maint", "IDLE", "MAINTENANCE"),
        ("mix", "MIXED", ""),
        ("npc perfctrs", "IDLE", "PERFCTRS"),
        ("plnd", "IDLE", "PLANNED"),
        ("pow_dn powered_down power_down", "IDLE", "POWERED_DOWN"),
        ("powering_down", "IDLE", "POWERING_DOWN"),
        ("pow_up powering_up", "IDLE", "POWERING_UP"),
        ("resv reserved", "IDLE", "RESERVED"),
        ("boot booting", "IDLE", "REBOOT_ISSUED"),
        ("unk", "UNKNOWN", ""),
        ("inval", "INVALID", ""),
    )
    for name in names.split()
}


def parse_node_state(text: str) -> NodeState:
    """A node state from sinfo (``%t``: ``down*``, ``mix``, ``drng``; ``%T``: ``drained``,
    ``completing*``) or scontrol (``IDLE+DRAIN``, ``DOWN+NOT_RESPONDING``, ``MIXED#``)."""
    if not text.strip():
        raise SlurmFormatError("an empty node state")
    flags: set[str] = set()
    words = []
    for word in text.strip().split("+"):
        while word and word[-1] in _SUFFIX_FLAGS:
            flags.add(_SUFFIX_FLAGS[word[-1]])
            word = word[:-1]
        if not word:
            raise SlurmFormatError(f"not a SLURM node state: {text!r}")
        words.append(word)
    base, extra = _SINFO_STATES.get(words[0].lower(), (words[0].upper(), frozenset()))
    flags |= extra | {word.upper() for word in words[1:]}
    if "DRAINED" in flags or "DRAINING" in flags:  # spelled out by some versions
        flags = (flags - {"DRAINED", "DRAINING"}) | {"DRAIN"}
    return NodeState(base, frozenset(flags))


def expand_hostlist(text: str) -> list[str]:
    """The host names of a SLURM host list (``n[1-3,7],gpu[01-02]`` → n1 n2 n3 n7 gpu01 gpu02),
    zero padding kept, in order; the same as ``scontrol show hostnames``."""
    names: list[str] = []
    for item in _split_top_level(text.strip()):
        match = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\](.*)", item)
        if match is None:
            if "[" in item or "]" in item:
                raise SlurmFormatError(f"not a SLURM host list: {text!r}")
            names.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        tails = expand_hostlist(suffix) if suffix else [""]
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()) or int(high or low) < int(low):
                raise SlurmFormatError(f"not a SLURM host list: {text!r} (range {part!r})")
            width = len(low)
            for number in range(int(low), int(high or low) + 1):
                names += [f"{prefix}{number:0{width}d}{tail}" for tail in tails]
    return names


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets."""
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if current:
        items.append("".join(current))
    return [item for item in items if item]


def pending_reason(fields: dict[str, str]) -> str:
    """The reason of a job or node record (``Reason=``), without SLURM's decorations (the
    ``[user@time]`` it appends to a node's reason); ``None`` when it gives none."""
    return _REASON_STAMP.sub("", fields.get("Reason", "")).strip() or "None"
