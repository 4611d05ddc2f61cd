"""A client waiting for its SLURM job's agents: until the job runs and every node's agent has
written its address to the job directory, showing progress, bounded.

The address files are looked at often (a directory read: cheap, so the client sees the last
agent within milliseconds); SLURM is asked less often (a ``scontrol`` call, which also costs
slurmctld), and at once when every file is there before the job's nodes are known.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import socket
import time
from collections.abc import Callable, Iterable

from job._formats import FINISHED_JOB_STATES, HOPELESS_PENDING_REASONS, pending_reason
from job._jobdir import JobDir
from job._scheduler import SlurmError, cancel, job_nodes, job_record

#: How often the client looks for the agents' address files, and asks SLURM about the job:
#: often while it is queued, less once it runs (only to see it end early or be requeued), so
#: that ``scontrol`` takes no CPU from the agents starting on the nodes.
LOOK_EVERY_S = 0.01
ASK_EVERY_S = 0.25
ASK_RUNNING_EVERY_S = 1.0


class AgentsWait:
    """Waits for the agents of job `job_id` (called `name`, `total` nodes) in `job_dir`,
    telling `report` each new progress line (queued, starting, N of M agents up)."""

    def __init__(
        self,
        job_id: str,
        name: str,
        job_dir: JobDir,
        total: int,
        report: Callable[[str], None],
    ) -> None:
        self.job_id, self.name, self.job_dir, self.total = job_id, name, job_dir, total
        self.report = report
        self.nodes: list[str] = []
        self.restart = 0  # SLURM's requeue count: the agents of this run are waited for

    def until(self, deadline: float) -> tuple[list[str], dict[str, str], int]:
        """The job's nodes in SLURM's order, each one's agent address and the requeue count,
        once all are there: SlurmError if the job ends or cannot start, TimeoutError (saying
        how far it got) after `deadline` (`time.monotonic`)."""
        shown, line, asked_at = "", "", -math.inf
        while True:
            written = self.job_dir.agents_written(self.restart)
            every = ASK_RUNNING_EVERY_S if self.nodes else ASK_EVERY_S
            if time.monotonic() - asked_at >= every or (not self.nodes and written >= self.total):
                line = self._ask_slurm()
                asked_at = time.monotonic()
            found = self.job_dir.agent_addresses(self.nodes, self.restart) if self.nodes else {}
            if self.nodes:
                line = progress_line(self.job_id, "RUNNING", "", len(found), self.total)
            if line != shown:
                self.report(line)
                shown = line
            if self.nodes and len(found) == len(self.nodes):
                return self.nodes, found, self.restart
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"SLURM job {self.job_id} ({self.name}) was not up in time: {line}; see "
                    f"{self.job_dir.output_file(self.job_id)}"
                )
            time.sleep(LOOK_EVERY_S)

    def _ask_slurm(self) -> str:
        """Ask SLURM about the job (its nodes once it runs, its requeue count); the progress
        line. SlurmError if it ended or cannot start (then it is cancelled)."""
        record = job_record(self.job_id)
        if record is None:
            raise SlurmError(f"SLURM job {self.job_id} ({self.name}) is gone (SLURM forgot it)")
        state = record.get("JobState", "UNKNOWN")
        reason = pending_reason(record)
        if state in FINISHED_JOB_STATES or state.split("+")[0] in FINISHED_JOB_STATES:
            raise SlurmError(self._ended_message(state, reason))
        if state == "PENDING" and reason in HOPELESS_PENDING_REASONS:
            cancel(self.job_id)
            raise SlurmError(
                f"SLURM job {self.job_id} ({self.name}) cannot start: it is pending with reason "
                f"{reason}; cancelled it"
            )
        self.nodes = job_nodes(record) if state in ("RUNNING", "COMPLETING") else []
        self.restart = int(record.get("Restarts", "0") or 0)
        return progress_line(self.job_id, state, reason, 0, self.total)

    def _ended_message(self, state: str, reason: str) -> str:
        output = self.job_dir.output_file(self.job_id)
        tail = ""
        with contextlib.suppress(OSError):
            lines = output.read_text(errors="replace").strip().splitlines()[-5:]
            tail = "; its output ends with: " + " / ".join(lines) if lines else ""
        return (
            f"SLURM job {self.job_id} ({self.name}) ended before its agents came up: state "
            f"{state}, reason {reason}{tail} ({output})"
        )


def progress_line(job_id: str, state: str, reason: str, up: int, total: int) -> str:
    """What a waiting client shows: queued (why), starting, or N of M agents up."""
    if state == "PENDING":
        return f"SLURM job {job_id}: queued ({reason})"
    if state in ("CONFIGURING", "RUNNING") and up == 0:
        return f"SLURM job {job_id}: starting"
    return f"SLURM job {job_id}: {up} of {total} agents up"


def client_host(agent_addresses: Iterable[str]) -> str:
    """Where this client must listen for procs on the agents at `agent_addresses` to reach it:
    loopback when every agent is on loopback, else this machine's address on the route to the
    first agent elsewhere (no packet is sent: a UDP socket only picks its source address)."""
    for address in agent_addresses:
        host = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = ipaddress.ip_address(socket.gethostbyname(host))
        if ip.is_loopback:
            continue
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((str(ip), 9))
            local: str = probe.getsockname()[0]
            return local
    return "127.0.0.1"
