"""The invariants every chaos run checks on its own: each fault observed as expected and
healed, no stray event, a client that never failed nor hung, and nothing left behind."""

from __future__ import annotations

import time

from ._allocation import Allocation
from ._clients import Clients
from ._model import FaultRecord, InvariantResult, ObservedEvent
from ._options import ChaosOptions


def builtin_invariants(
    faults: list[FaultRecord], events: list[ObservedEvent], clients: Clients
) -> list[InvariantResult]:
    """The verdicts on the faults, the events and the workload's clients."""
    wrong = [r for r in faults if r.verdict != "ok"]
    observed = InvariantResult(
        "every fault observed as expected and healed",
        not wrong,
        "; ".join(
            f"#{r.index} {r.planned.fault.describe()}: {r.verdict} {r.note}".strip() for r in wrong
        ),
        True,
    )
    unexpected = [e for e in events if e.fault is None]
    stray = InvariantResult(
        "no supervision event without a fault",
        not unexpected,
        "; ".join(e.message for e in unexpected[:5]),
        True,
    )
    return [observed, stray, *_client_invariants(clients)]


def _client_invariants(clients: Clients) -> list[InvariantResult]:
    client = clients.current
    crash = client.crash if client is not None else None
    survived = InvariantResult(
        "the client never failed",
        crash is None,
        (crash or "").strip().splitlines()[-1] if crash else "",
        True,
    )
    limit = clients.options.client_hang_s
    hung = InvariantResult(
        "the client never hung",
        clients.max_gap <= limit,
        f"longest time without progress: {clients.max_gap:.2f} s (limit {limit:g} s)",
        True,
    )
    return [survived, hung]


def check_leftovers(
    alloc: Allocation, orphans_of_killed: set[int], options: ChaosOptions
) -> list[InvariantResult]:
    """After the last client: no proc left on the agents, no socket file left behind."""
    deadline = time.monotonic() + options.owner_timeout_s + 10.0
    while alloc.procs() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = alloc.procs() | {p for p in orphans_of_killed if _alive(p)}
    sockets = alloc.leftover_sockets()
    return [
        InvariantResult(
            "no orphan process",
            not left,
            f"still running: {sorted(left)}" if left else "",
            True,
        ),
        InvariantResult(
            "no socket file left",
            not sockets,
            ", ".join(p.name for p in sockets),
            True,
        ),
    ]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
