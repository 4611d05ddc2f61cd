"""The pytest plugin: a ``chaos`` fixture, a ``chaos`` marker and ``--chaos-seed``.

    @pytest.mark.chaos(mtbf=1.0, faults="kill,pause", duration=10)
    def test_job_survives(chaos):
        chaos.run("tests/my_workloads.py:training")   # fails the test if an invariant broke

The marker sets the random schedule (any `RandomSchedule` field, with ``mtbf``, ``duration``
and ``faults`` as short names) and harness options (any `ChaosOptions` field). The seed comes
from ``--chaos-seed``, else the marker's ``seed``, else 0, so CI runs are reproducible and a
failure can be replayed. A failed run fails the test with the whole report attached;
``--chaos-report DIR`` also writes every run's JSON report there.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from ._report import RunReport
    from ._schedule import Schedule

_SHORT_NAMES = {"mtbf": "mtbf_s", "duration": "duration_s", "warmup": "warmup_s"}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("meshvisor chaos")
    group.addoption(
        "--chaos-seed",
        type=int,
        default=None,
        help="seed of every chaos schedule (default: the marker's seed, else 0)",
    )
    group.addoption(
        "--chaos-report",
        type=Path,
        default=None,
        help="directory to write the JSON report of every chaos run to",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "chaos(seed=0, mtbf=2.0, duration=10.0, faults='kill', hosts=2, ...): the fault "
        "schedule and harness options of the chaos fixture",
    )


class ChaosFixture:
    """What the ``chaos`` fixture gives a test: `run` a workload under the marker's schedule."""

    def __init__(self, request: pytest.FixtureRequest, seed: int | None) -> None:
        self._request = request
        self._seed = seed
        marker = request.node.get_closest_marker("chaos")
        self.settings: dict[str, Any] = dict(marker.kwargs) if marker is not None else {}
        self.reports: list[RunReport] = []
        _check_settings(self.settings)

    @property
    def seed(self) -> int:
        if self._seed is not None:
            return self._seed
        return int(self.settings.get("seed", 0))

    def run(
        self,
        workload: str | Callable[..., Any],
        schedule: Schedule | None = None,
        *,
        check: bool = True,
        **overrides: Any,
    ) -> RunReport:
        """Run `workload` under `schedule` (default: a random one from the marker); with
        `check`, fail the test unless every invariant held."""
        from ._harness import run_chaos
        from ._options import ChaosOptions
        from ._render import render_text

        settings = {**self.settings, **overrides}
        options = ChaosOptions(**_pick(settings, ChaosOptions))
        report = run_chaos(workload, schedule or self._schedule(settings), options)
        self.reports.append(report)
        text = render_text(report)
        self._request.node.add_report_section("call", "chaos report", text)
        self._save(report)
        if check and not report.ok:
            pytest.fail(f"chaos invariants did not hold (replay: {report.replay})\n\n{text}")
        return report

    def _schedule(self, settings: dict[str, Any]) -> Schedule:
        from ._schedule import RandomSchedule

        fields = {_SHORT_NAMES.get(k, k): v for k, v in settings.items()}
        fields["seed"] = self.seed
        faults = fields.pop("faults", "kill")
        if isinstance(faults, str):
            return RandomSchedule.from_mix(
                fields.pop("seed"),
                fields.pop("mtbf_s", 2.0),
                fields.pop("duration_s", 10.0),
                faults,
                **_pick(fields, RandomSchedule),
            )
        fields["faults"] = tuple(faults)
        return RandomSchedule(**_pick(fields, RandomSchedule))

    def _save(self, report: RunReport) -> None:
        directory = self._request.config.getoption("--chaos-report")
        if directory is None:
            return
        directory.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", self._request.node.nodeid)
        report.to_json(directory / f"{name}-{len(self.reports)}.json")


def _check_settings(settings: dict[str, Any]) -> None:
    from ._options import ChaosOptions
    from ._schedule import RandomSchedule

    known = {f.name for cls in (RandomSchedule, ChaosOptions) for f in dataclasses.fields(cls)}
    known |= set(_SHORT_NAMES)
    unknown = sorted(set(settings) - known)
    if unknown:
        raise pytest.UsageError(
            f"unknown chaos marker option(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )


def _pick(settings: dict[str, Any], cls: type) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in settings.items() if k in names}


@pytest.fixture
def chaos(request: pytest.FixtureRequest) -> ChaosFixture:
    """Run workloads under fault injection; see the module docstring."""
    return ChaosFixture(request, request.config.getoption("--chaos-seed"))
