"""Workspace sync: the first sync of a tree, a re-sync after one file changed, and a re-sync of
nothing, to two host agents, against copying the whole tree with ``cp -r`` (per host) in the
same run.

Two ``meshvisor agent`` daemons (tcp on loopback, separate run directories) play two hosts;
this process attaches to them. The tree: N files (small Python modules) plus one large file,
M MB in all. A sync reads each changed file once and sends it to every host that lacks it;
a re-sync hashes the local tree again and sends only what changed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
#: One measurement: sync seconds, `cp -r` seconds, bytes the hosts wrote.
Row = tuple[float, float, int]


def _tree(root: Path, files: int, megabytes: int) -> None:
    """`files` small modules in folders of 50, and one file making the tree `megabytes` MB."""
    for i in range(files):
        folder = root / "pkg" / f"part{i // 50}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"mod{i}.py").write_text(f"VALUE = {i}\n" + "# padding\n" * 100)
    small = sum(p.stat().st_size for p in root.rglob("*.py"))
    (root / "pkg" / "weights.bin").write_bytes(os.urandom(max(0, (megabytes << 20) - small)))


def _start_agents(folder: Path, count: int) -> list[subprocess.Popen[bytes]]:
    alloc, agents = folder / "hosts", []
    for i in range(count):
        (folder / f"run{i}").mkdir(mode=0o700)
        command = [sys.executable, "-m", "meshvisor", "agent", "--listen", "tcp://127.0.0.1:0"]
        command += ["--rundir", str(folder / f"run{i}"), "--allocation", str(alloc)]
        agents.append(subprocess.Popen(command))
    deadline = time.monotonic() + 60
    while not alloc.exists() or len(alloc.read_text().split()) < count:
        if time.monotonic() > deadline:
            raise RuntimeError("the agents did not start within 60 s")
        time.sleep(0.05)
    return agents


def _timed(action: Callable[[], T]) -> tuple[float, T]:
    start = time.perf_counter()
    result = action()
    return time.perf_counter() - start, result


def _copy_per_host(source: Path, targets: list[Path]) -> None:
    for target in targets:
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run(["cp", "-r", str(source), str(target)], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=500)
    parser.add_argument("--megabytes", type=int, default=64)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="meshvisor-bench-wsync-"))
    os.chmod(folder, 0o700)
    agents = _start_agents(folder, 2)
    try:
        rows = _measure(folder, args.files, args.megabytes, args.trials)
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            agent.wait(60)
        shutil.rmtree(folder, ignore_errors=True)
    _report(rows, args, args.json)
    return 0


def _measure(folder: Path, files: int, megabytes: int, trials: int) -> dict[str, list[Row]]:
    from mesh import attach
    from mesh.testing import shutdown

    hosts = attach(str(folder / "hosts"))
    hosts.wait_for_agents(60)
    rows: dict[str, list[Row]] = {"first sync": [], "one file changed": [], "nothing changed": []}
    for trial in range(trials):
        code = folder / f"code{trial}"
        _tree(code, files, megabytes)
        for name, row in _trial(hosts, code, [folder / "copy0", folder / "copy1"]).items():
            rows[name].append(row)
    shutdown()  # this client's session ends before its agents do
    return rows


def _trial(hosts: Any, code: Path, copies: list[Path]) -> dict[str, Row]:
    """Sync `code` (new), change one file and sync, sync again; each against `cp -r`."""

    def sync() -> Any:
        return hosts.sync_workspace(code, progress=False).get(600)

    copy = functools.partial(_copy_per_host, code, copies)
    rows = {}
    first_s, first = _timed(sync)
    rows["first sync"] = (first_s, _timed(copy)[0], first.bytes_written)
    (code / "pkg" / "part0" / "mod0.py").write_text("VALUE = -1\n")
    one_s, one = _timed(sync)
    copy_s = _timed(copy)[0]
    rows["one file changed"] = (one_s, copy_s, one.bytes_written)
    none_s, none = _timed(sync)
    rows["nothing changed"] = (none_s, copy_s, none.bytes_written)
    return rows


def _report(rows: dict[str, list[Row]], args: argparse.Namespace, as_json: bool) -> None:
    medians = {
        name: tuple(statistics.median(trial[i] for trial in trials) for i in range(3))
        for name, trials in rows.items()
    }
    if as_json:
        print(json.dumps({"files": args.files, "megabytes": args.megabytes, "rows": medians}))
        return
    print(
        f"tree: {args.files} files + 1 large, {args.megabytes} MB; 2 hosts; median of {args.trials}"
    )
    print(f"{'':18} {'sync':>10} {'cp -r x2':>10} {'ratio':>7} {'bytes sent (2 hosts)':>22}")
    for name, (sync_s, copy_s, sent) in medians.items():
        print(
            f"{name:18} {sync_s:>8.3f} s {copy_s:>8.3f} s {sync_s / copy_s:>7.2f} {int(sent):>22,}"
        )


if __name__ == "__main__":
    sys.exit(main())
