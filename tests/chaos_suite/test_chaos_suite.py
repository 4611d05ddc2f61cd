"""The chaos suite shipped with meshvisor: a ledger of actors under a mixed, seeded schedule
of every kind of fault; every invariant must hold. Replay a failure with the seed it prints
(``pytest tests/chaos_suite --chaos-seed N``)."""

from __future__ import annotations

from pathlib import Path

import pytest

LEDGER = f"{Path(__file__).parent / 'ledger.py'}:ledger"

pytestmark = pytest.mark.timeout(300)


ALL_KINDS = "kill:3,pause:1,raise:1,drop:1,delay:1,partition:1,kill_agent:1,kill_client:1"


@pytest.mark.chaos(
    seed=1,  # its 17 faults include every kind; --chaos-seed N runs another schedule
    mtbf=1.0,
    duration=25.0,
    warmup=1.0,
    faults=ALL_KINDS,
    pause_s=(0.3, 2.5),
    window_s=(0.5, 3.0),
    settle_s=0.5,
)
def test_ledger_survives_mixed_faults(chaos) -> None:  # type: ignore[no-untyped-def]
    report = chaos.run(LEDGER)  # fails the test, with the report, unless every invariant held
    assert report.faults, report.replay


@pytest.mark.chaos(mtbf=0.6, duration=10.0, faults="kill,pause", max_concurrent=2, settle_s=1.0)
def test_ledger_survives_concurrent_kills(chaos) -> None:  # type: ignore[no-untyped-def]
    report = chaos.run(LEDGER)
    assert report.faults, report.replay
