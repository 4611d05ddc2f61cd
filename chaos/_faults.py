"""Fault kinds: the `Fault` value, and one `FaultSpec` per kind in the table `FAULT_SPECS`.

A spec holds everything chaos decides by the kind of a fault: the level of target it is aimed
at, its description, the supervision events that count as noticing it, how a random schedule
draws one, how the harness injects it and how the harness heals it. Adding a kind means adding
its constructor to `Fault` and its spec to the table, here and nowhere else.

Long because that rule keeps every kind in this one module: ten kinds of a few lines each,
which `Fault` and the table both need (splitting them would make an import cycle).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from ._fault_sites import Detectors, FaultRanges, FaultSite
from ._targets import Target, TargetLevel

FaultKind = Literal[
    "kill",
    "pause",
    "raise",
    "drop",
    "delay",
    "partition",
    "kill_agent",
    "kill_client",
    "kill_node",
    "preempt",
]
#: Among the expected event kinds: no event is fine too.
NO_EVENT = "none"
#: The heartbeat timeout of a target mesh's procs unless the workload gives another.
DEFAULT_HEARTBEAT_TIMEOUT_S = 2.0
#: The chance that a random "kill" exits with a code instead of dying of a signal.
EXIT_PROBABILITY = 0.2
#: How long a lost node stays lost unless its loss is seen sooner: long enough for the owner
#: to notice the silence, short enough to bring it back before SLURM declares it DOWN (the
#: local cluster's SlurmdTimeout is 10 s; real clusters use minutes).
NODE_LOST_AT_MOST_S = 6.0
#: How long SLURM's notice may take to reach every process of the job.
NOTICE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Fault:
    """One fault to inject. Build with the class methods, e.g. ``Fault.kill("SIGSEGV")``."""

    kind: FaultKind
    signal: str | None = None  # kill: the signal's name
    exit_code: int | None = None  # kill: exit with this code instead of a signal
    duration_s: float = 0.0  # pause, drop, delay, partition: how long it lasts
    probability: float = 0.0  # drop: chance that each message is dropped
    delay_ms: float = 0.0  # delay: added to each message
    endpoint: str | None = None  # raise: the endpoint that raises (None: any endpoint)
    fatal: bool = True  # raise: a BaseException that fails the actor, or a plain Exception

    @classmethod
    def kill(cls, signal: str = "SIGKILL") -> Fault:
        """The target's process dies of `signal`."""
        return cls("kill", signal=signal)

    @classmethod
    def exit(cls, code: int) -> Fault:
        """The target's process exits with `code`."""
        return cls("kill", exit_code=code)

    @classmethod
    def pause(cls, duration_s: float) -> Fault:
        """The target's process is stopped (SIGSTOP) for `duration_s`."""
        return cls("pause", duration_s=duration_s)

    @classmethod
    def raise_in(cls, endpoint: str | None = None, *, fatal: bool = True) -> Fault:
        """The next call of `endpoint` (any endpoint if None) raises."""
        return cls("raise", endpoint=endpoint, fatal=fatal)

    @classmethod
    def drop(cls, probability: float, duration_s: float) -> Fault:
        """Messages between the client and the target are dropped for `duration_s`."""
        return cls("drop", probability=probability, duration_s=duration_s)

    @classmethod
    def delay(cls, delay_ms: float, duration_s: float) -> Fault:
        """Messages between the client and the target are delayed for `duration_s`."""
        return cls("delay", delay_ms=delay_ms, duration_s=duration_s)

    @classmethod
    def partition(cls, duration_s: float) -> Fault:
        """A host is cut off from the client for `duration_s`."""
        return cls("partition", duration_s=duration_s)

    @classmethod
    def kill_agent(cls) -> Fault:
        """A host's agent is killed (and started again)."""
        return cls("kill_agent")

    @classmethod
    def kill_client(cls) -> Fault:
        """The workload's client is killed (and started again)."""
        return cls("kill_client")

    @classmethod
    def kill_node(cls) -> Fault:
        """A host's SLURM node is lost (and brought back before SLURM declares it down)."""
        return cls("kill_node")

    @classmethod
    def preempt(cls) -> Fault:
        """SLURM's preemption notice reaches the job (its warning signal)."""
        return cls("preempt")

    def __post_init__(self) -> None:
        if self.kind not in FAULT_SPECS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {', '.join(FAULT_KINDS)}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"a drop probability must be within [0, 1], not {self.probability}")
        if self.duration_s < 0 or self.delay_ms < 0:
            raise ValueError("fault durations and delays cannot be negative")

    @property
    def spec(self) -> FaultSpec:
        """What chaos knows about this fault's kind."""
        return FAULT_SPECS[self.kind]

    def describe(self) -> str:
        """A short human description, e.g. ``kill SIGKILL`` or ``pause 1.5 s``."""
        return self.spec.describe(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fault:
        return cls(**data)


Describe = Callable[[Fault], str]
Expect = Callable[[Fault, Detectors], tuple[str, ...]]
Draw = Callable[[FaultRanges, random.Random], Fault]
Act = Callable[[Fault, Target, FaultSite], None]


def _wait_out(fault: Fault, target: Target, site: FaultSite) -> None:
    """Heal by waiting until the fault's duration is over (its rules expire on their own)."""
    time.sleep(site.remaining_s(fault.duration_s))


def _no_event(fault: Fault, detectors: Detectors) -> tuple[str, ...]:
    """No supervision event should come: the job rides the fault out."""
    return ()


def _any_ranges(ranges: FaultRanges) -> None:
    """Any ranges will do for drawing this kind."""


@dataclass(frozen=True)
class FaultSpec:
    """Everything chaos decides by the kind of a fault (one entry of `FAULT_SPECS`)."""

    kind: FaultKind
    #: The level of target the fault is aimed at.
    level: TargetLevel
    #: A short human description of a fault of this kind (`Fault.describe`).
    describe: Describe
    #: The event kinds that count as the owner noticing the fault (`NO_EVENT` among them: no
    #: event is fine too; an empty tuple: no event should come).
    expected: Expect
    #: A fault of this kind with its parameters drawn from a random schedule's ranges.
    draw: Draw
    #: Inject the fault into its target (the site's pids are the target's processes).
    inject: Act
    #: Undo the fault (or wait until it is over) so that the target can answer again.
    heal: Act = _wait_out
    #: Whether the target's processes are gone afterwards (healthy answers come from others).
    kills_process: bool = False
    #: Raise ValueError unless a random schedule's ranges can draw a fault of this kind.
    check_ranges: Callable[[FaultRanges], None] = _any_ranges
    #: Whether the fault acts on SLURM's nodes or job (only a run on SLURM can inject it).
    needs_slurm: bool = False


def _around(duration_s: float, timeout_s: float, kind: str) -> tuple[str, ...]:
    """A fault that lasts `duration_s` against a detector with `timeout_s`: clearly longer
    must be seen, clearly shorter must not, and in between either is right."""
    if duration_s >= timeout_s + 1.0:
        return (kind,)
    if duration_s <= timeout_s - 0.5:
        return ()
    return (kind, NO_EVENT)


def _signal_first(site: FaultSite, signum: int) -> None:
    os.kill(next(iter(site.pids), 0), signum)


# -- kill ------------------------------------------------------------------------------------


def _draw_kill(ranges: FaultRanges, rng: random.Random) -> Fault:
    if ranges.exit_codes and (not ranges.kill_signals or rng.random() < EXIT_PROBABILITY):
        return Fault.exit(rng.choice(ranges.exit_codes))
    return Fault.kill(rng.choice(ranges.kill_signals))


def _check_kill_ranges(ranges: FaultRanges) -> None:
    if not ranges.kill_signals and not ranges.exit_codes:
        raise ValueError('a "kill" needs at least one of kill_signals or exit_codes')


def _inject_kill(fault: Fault, target: Target, site: FaultSite) -> None:
    if fault.exit_code is not None:
        site.request("exit", mesh=target.mesh, rank=target.rank, code=fault.exit_code)
    else:
        _signal_first(site, signal.Signals[fault.signal or "SIGKILL"])


KILL = FaultSpec(
    "kill",
    "rank",
    describe=lambda f: f"exit {f.exit_code}" if f.exit_code is not None else f"kill {f.signal}",
    expected=lambda f, d: ("exit",) if f.exit_code is not None else ("signal",),
    draw=_draw_kill,
    inject=_inject_kill,
    kills_process=True,
    check_ranges=_check_kill_ranges,
)

# -- pause -----------------------------------------------------------------------------------


def _resume(fault: Fault, target: Target, site: FaultSite) -> None:
    """Resume the paused processes when the pause ends; a pause seen as a hang heals before."""
    resume = threading.Timer(
        site.remaining_s(fault.duration_s), _continue_quietly, (set(site.pids),)
    )
    resume.start()
    if not site.detected.wait(site.remaining_s(fault.duration_s)):
        resume.join()


def _continue_quietly(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


PAUSE = FaultSpec(
    "pause",
    "rank",
    describe=lambda f: f"pause {f.duration_s:g} s",
    expected=lambda f, d: _around(f.duration_s, d.heartbeat_timeout_s, "hung"),
    draw=lambda r, rng: Fault.pause(round(rng.uniform(*r.pause_s), 3)),
    inject=lambda f, t, site: _signal_first(site, signal.SIGSTOP),
    heal=_resume,
)

# -- raise -----------------------------------------------------------------------------------


def _describe_raise(fault: Fault) -> str:
    where = fault.endpoint or "any endpoint"
    return f"raise in {where}" + ("" if fault.fatal else " (non-fatal)")


def _inject_raise(fault: Fault, target: Target, site: FaultSite) -> None:
    site.request(
        "raise", mesh=target.mesh, rank=target.rank, endpoint=fault.endpoint, fatal=fault.fatal
    )


RAISE = FaultSpec(
    "raise",
    "rank",
    describe=_describe_raise,
    expected=lambda f, d: ("exception",) if f.fatal else (),
    draw=lambda r, rng: Fault.raise_in(r.raise_endpoint),
    inject=_inject_raise,
)

# -- drop and delay --------------------------------------------------------------------------


def _break_links(fault: Fault, target: Target, site: FaultSite) -> None:
    site.request(
        "links",
        mesh=target.mesh,
        rank=target.rank,
        duration_s=fault.duration_s,
        probability=fault.probability,
        delay_s=fault.delay_ms / 1000.0,
        seed=site.link_seed(),
    )


def _draw_delay(ranges: FaultRanges, rng: random.Random) -> Fault:
    delay_ms = round(rng.uniform(*ranges.delay_ms), 3)
    return Fault.delay(delay_ms, round(rng.uniform(*ranges.window_s), 3))


DROP = FaultSpec(
    "drop",
    "rank",
    describe=lambda f: f"drop {f.probability:.0%} for {f.duration_s:g} s",
    expected=_no_event,
    draw=lambda r, rng: Fault.drop(r.drop_probability, round(rng.uniform(*r.window_s), 3)),
    inject=_break_links,
)
DELAY = FaultSpec(
    "delay",
    "rank",
    describe=lambda f: f"delay {f.delay_ms:g} ms for {f.duration_s:g} s",
    expected=_no_event,
    draw=_draw_delay,
    inject=_break_links,
)

# -- hosts and the client --------------------------------------------------------------------


def _host(target: Target) -> int:
    if target.host is None:
        raise ValueError(f"a host fault needs a host target, not {target}")
    return target.host


PARTITION = FaultSpec(
    "partition",
    "host",
    describe=lambda f: f"partition {f.duration_s:g} s",
    expected=lambda f, d: _around(f.duration_s, d.agent_timeout_s, "unreachable"),
    draw=lambda r, rng: Fault.partition(round(rng.uniform(*r.window_s), 3)),
    inject=lambda f, t, site: site.request("partition", host=t.host, duration_s=f.duration_s),
)
KILL_AGENT = FaultSpec(
    "kill_agent",
    "host",
    describe=lambda f: "kill agent",
    expected=lambda f, d: ("unreachable",),
    draw=lambda r, rng: Fault.kill_agent(),
    inject=lambda f, t, site: site.kill_agent(_host(t)),
    heal=lambda f, t, site: site.restart_agent(_host(t)),
    kills_process=True,
)
KILL_CLIENT = FaultSpec(
    "kill_client",
    "client",
    describe=lambda f: "kill client",
    expected=_no_event,
    draw=lambda r, rng: Fault.kill_client(),
    inject=lambda f, t, site: site.kill_client(),
    heal=lambda f, t, site: site.restart_client(),
)


# -- SLURM's nodes and job -------------------------------------------------------------------


def _restore_node(fault: Fault, target: Target, site: FaultSite) -> None:
    """Bring a lost node back once the owner has seen it lost (a lost machine is noticed by
    its silence, not by its agent coming back), or after `NODE_LOST_AT_MOST_S`."""
    site.detected.wait(site.remaining_s(NODE_LOST_AT_MOST_S))
    site.restore_node(_host(target))


KILL_NODE = FaultSpec(
    "kill_node",
    "host",
    describe=lambda f: "kill node",
    expected=lambda f, d: ("unreachable",),
    draw=lambda r, rng: Fault.kill_node(),
    inject=lambda f, t, site: site.kill_node(_host(t)),
    heal=_restore_node,
    kills_process=True,
    needs_slurm=True,
)


def _every_process_told(fault: Fault, target: Target, site: FaultSite) -> None:
    """A notice is healed once every process of the job was told (each handler may drain)."""
    told = site.wait_until_every_process_told(NOTICE_TIMEOUT_S)
    if told < len(site.pids):
        raise RuntimeError(
            f"the notice reached {told} of the {len(site.pids)} processes of the job's targets "
            f"in {NOTICE_TIMEOUT_S:g} s"
        )


PREEMPT = FaultSpec(
    "preempt",
    "job",
    describe=lambda f: "preemption notice",
    expected=lambda f, d: ("preempting",),
    draw=lambda r, rng: Fault.preempt(),
    inject=lambda f, t, site: site.preempt(),
    heal=_every_process_told,
    needs_slurm=True,
)

#: Every fault kind's spec, in the order used by reports and ``--faults``.
FAULT_SPECS: Mapping[str, FaultSpec] = MappingProxyType(
    {
        spec.kind: spec
        for spec in (
            KILL,
            PAUSE,
            RAISE,
            DROP,
            DELAY,
            PARTITION,
            KILL_AGENT,
            KILL_CLIENT,
            KILL_NODE,
            PREEMPT,
        )
    }
)
#: Every fault kind, in the order used by reports and ``--faults``.
FAULT_KINDS: tuple[FaultKind, ...] = tuple(spec.kind for spec in FAULT_SPECS.values())
