"""Evidence of why a proc died, gathered by its host agent for the exit report.

- Stacks: each proc has faulthandler write to a private file of the agent's run directory
  (`proc_faults`): on a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) and on
  `DUMP_SIGNAL`, which the agent sends to a proc it declared hung. faulthandler dumps the
  Python stacks of all threads from a C signal handler, so even a proc whose thread holds the
  GIL answers; then the signal's default action ends the proc. A stopped proc is continued for
  the dump; one that does not die within `DUMP_WAIT_S` is SIGKILLed, and its report says that
  no stack could be read.
- Out of memory: a proc over its own memory limit leaves a note (`proc_faults`); a proc the
  kernel's OOM killer SIGKILLed is told by its cgroup's oom_kill counter (`oom_kills`). Both
  count for a proc the agent had declared hung: slowed down by its memory, it may pass its
  limit or be OOM-killed before the agent's kill lands, and that is the cause to report.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from mesh._agent.forkserver import ForkServerClient
from mesh._agent.oom_kills import CgroupMemory, killed_by_oom, sample_memory_cgroup
from mesh._agent.procs import ProcRecord, exit_report
from mesh._agent.stacks import relevant_first
from mesh._engine.messages import ProcExited
from mesh._engine.proc_faults import DUMP_SIGNAL, oom_note_path, stacks_path

#: How long a hung proc gets to dump its stacks and die of `DUMP_SIGNAL` before SIGKILL.
DUMP_WAIT_S = 2.0
#: The most of a dump kept (the start: the header and the most relevant threads come first).
MAX_EVIDENCE_BYTES = 64 * 1024


def declare_hung(forkserver: ForkServerClient, proc: ProcRecord, why: str, now: float) -> None:
    """`proc` is hung (`why`): ask it for its stacks (continuing it if it is stopped); it dies
    once they are written, and the agent's kill deadline SIGKILLs it if it cannot answer
    within `DUMP_WAIT_S`."""
    proc.hung = proc.stop_requested = True
    proc.why_hung = why
    if proc.pid is None:
        return
    if DUMP_SIGNAL is None:  # no real-time signals here: no dump
        proc.kill_at = now
        return
    forkserver.signal(proc.pid, DUMP_SIGNAL)
    forkserver.signal(proc.pid, signal.SIGCONT)  # a stopped proc dumps only once continued
    proc.dump_requested_at = time.monotonic()
    proc.kill_at = now + DUMP_WAIT_S


def note_ready(proc: ProcRecord) -> None:
    """`proc` said it is ready: sample its memory cgroup, to tell an OOM kill from others."""
    if proc.pid is not None:
        proc.memory = sample_memory_cgroup(proc.pid)


def exit_report_with_evidence(
    proc: ProcRecord, pid: int, code: int, signame: str | None, hostname: str, rundir: str
) -> ProcExited:
    """`procs.exit_report`, with the stacks `proc` left in `rundir` and why it ran out of
    memory."""
    evidence = take_evidence(rundir, proc, signame)
    return exit_report(proc, pid, code, signame, hostname, evidence)


def take_evidence(rundir: str, proc: ProcRecord, signame: str | None) -> tuple[str, str]:
    """The stacks `proc` dumped (or "") and why it ran out of memory (or ""), read once: the
    files are removed."""
    stacks = relevant_first(_take_text(stacks_path(rundir, proc.proc_id)))
    out_of_memory = _take_text(oom_note_path(rundir, proc.proc_id))
    killed_by_others = proc.stop_requested and not proc.hung  # a hung one may die of memory
    if not out_of_memory and signame == "SIGKILL" and not killed_by_others:
        out_of_memory = _kernel_oom(proc.memory)
    if proc.hung and not out_of_memory:  # else the stacks are where it ran out of memory
        proc.why_hung += _dump_outcome(proc, stacks, signame)
    return stacks, out_of_memory


def _kernel_oom(memory: CgroupMemory | None) -> str:
    """Why the kernel's OOM killer is the likely killer of a proc in cgroup `memory`, or ""."""
    return killed_by_oom(memory) if memory is not None else ""


def _dump_outcome(proc: ProcRecord, stacks: str, signame: str | None) -> str:
    """What the hung proc's report adds about its stacks."""
    if stacks.strip():
        waited = time.monotonic() - proc.dump_requested_at
        return f"; its Python stacks were dumped in {waited * 1e3:.0f} ms (see the traceback)"
    if signame == "SIGKILL":
        return (
            f"; no Python stack could be read: it did not answer the dump signal within "
            f"{DUMP_WAIT_S:g} s (stopped by a tracer, or stuck in the kernel)"
        )
    return "; no Python stack could be read: it died before dumping them"


def _take_text(path: str) -> str:
    """The text of the file at `path` (at most `MAX_EVIDENCE_BYTES`), removed; "" if none."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_EVIDENCE_BYTES + 1)
    except OSError:
        return ""
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    text = data[:MAX_EVIDENCE_BYTES].decode("utf-8", "replace")
    return text + ("\n... (cut)" if len(data) > MAX_EVIDENCE_BYTES else "")
