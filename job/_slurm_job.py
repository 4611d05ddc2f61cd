"""`SlurmJob`: host meshes from a SLURM allocation, one meshvisor host agent per node.

``SlurmJob(meshes={"trainers": 4, "spare": 1}, partition=..., time_limit=...)`` describes the
job; `apply` submits it (one job for all meshes); `state` waits, bounded and showing progress,
until every node's agent answers and gives a `HostMesh` per named mesh, with extent
``{"hosts": N}``. The job outlives its client when `persistent` (attach again with
`SlurmJob.attach(job_id_or_name)`): then it is a batch job (``sbatch``). Otherwise it is
cancelled when the client exits, even on SIGKILL (a reaper process watches the client), and
starts at once with ``salloc`` (`job._salloc`). The names follow Monarch's ``monarch.job``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from job._batch import restart_agent_step
from job._cache import CachedJob, job_fingerprint, live_cached_job, write_cached_job
from job._formats import LIVE_JOB_STATES, pending_reason
from job._job import JobTrait, check_meshes
from job._job_state import JobState
from job._jobdir import JobDir, JobSpec, job_dirs_matching
from job._reaper import start_reaper
from job._salloc import SallocRefusedOption, allocate, salloc_arguments
from job._sbatch import batch_script, sbatch_arguments
from job._scheduler import SlurmError, cancel, job_record, submit
from job._startup import AgentsWait, client_host
from mesh import attach
from mesh.tooling import current_session
from transport import CurveKeys, transport_settings, use_curve_keys

#: Where progress goes: one line per change (queued, starting, N of M agents up).
Progress = Callable[[str], None]

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _print_progress(line: str) -> None:
    print(f"meshvisor: {line}", file=sys.stderr, flush=True)


class SlurmJob(JobTrait):
    """One SLURM job giving named host meshes; see the module docstring."""

    def __init__(
        self,
        meshes: Mapping[str, int],
        *,
        name: str = "meshvisor",
        partition: str | None = None,
        time_limit: str | float | None = None,
        gpus_per_node: int | None = None,
        cpus_per_task: int | None = None,
        mem: str | None = None,
        account: str | None = None,
        qos: str | None = None,
        exclusive: bool = False,
        slurm_args: Sequence[str] = (),
        persistent: bool = False,
        requeue: bool = False,
        warning_signal: str = "USR1",
        warning_time_s: float | None = 60.0,
        listen_host: str | None = None,
        python_exe: str = sys.executable,
        start_timeout_s: float = 600.0,
        progress: Progress | None = _print_progress,
        job_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        check_meshes(meshes)
        if not _NAME.fullmatch(name):
            raise ValueError(f"job name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be positive, not {start_timeout_s}")
        self.name = name
        self.meshes = dict(meshes)
        self.persistent = persistent
        self._requeue = requeue
        self.start_timeout_s = start_timeout_s
        self._progress = progress
        self._root = Path(job_dir) if job_dir is not None else None
        self._python = python_exe
        self._listen_host = listen_host
        self._notice_signal = warning_signal if warning_time_s else None
        self._sbatch_args = sbatch_arguments(
            name=name,
            nodes=sum(self.meshes.values()),
            partition=partition,
            time_limit=time_limit,
            gpus_per_node=gpus_per_node,
            cpus_per_task=cpus_per_task,
            mem=mem,
            account=account,
            qos=qos,
            exclusive=exclusive,
            requeue=requeue,
            warning=f"{warning_signal}@{int(warning_time_s)}" if warning_time_s else None,
            extra=slurm_args,
        )
        self._dir: JobDir | None = None
        self._spec: JobSpec | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        self._salloc: subprocess.Popen[bytes] | None = None
        self._state: JobState | None = None

    # -- attaching to a job that runs -----------------------------------------------------------

    @classmethod
    def attach(
        cls,
        job: str | int,
        *,
        job_dir: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 600.0,
        progress: Progress | None = _print_progress,
    ) -> SlurmJob:
        """The job with SLURM id or name `job` that a `SlurmJob` submitted (from this client
        or another one), still queued or running; it is not cancelled when this client exits.
        LookupError if no job has that id or name, SlurmError if SLURM no longer runs it."""
        found = find_job(job, job_dir=job_dir, start_timeout_s=start_timeout_s, progress=progress)
        state = found.slurm_state()
        if state not in LIVE_JOB_STATES:
            raise SlurmError(found._no_longer_runs(state))
        return found

    @classmethod
    def current(cls, *, progress: Progress | None = _print_progress) -> SlurmJob:
        """In a batch-mode client script (``meshvisor slurm batch``): the job it runs in."""
        path = os.environ.get("MESHVISOR_SLURM_JOB_DIR")
        if not path:
            raise RuntimeError(
                "SlurmJob.current() works in a client script run by 'meshvisor slurm batch'; "
                "elsewhere use SlurmJob.attach(job_id_or_name)"
            )
        return cls._from_dir(JobDir(Path(path)), 600.0, progress)

    @classmethod
    def _from_dir(
        cls, found: JobDir, start_timeout_s: float, progress: Progress | None
    ) -> SlurmJob:
        spec = found.read_spec()
        job = cls.__new__(cls)
        job.name, job.meshes, job.persistent = spec.name, dict(spec.meshes), True
        job.start_timeout_s, job._progress = start_timeout_s, progress
        job._root, job._python, job._listen_host = found.path.parent, spec.python, None
        job._sbatch_args, job._requeue, job._salloc = [], False, None
        job._dir, job._spec, job._reaper, job._state = found, spec, None, None
        return job

    # -- the job --------------------------------------------------------------------------------

    @property
    def job_id(self) -> str | None:
        """SLURM's id of the job, once submitted."""
        return self._spec.job_id if self._spec else None

    @property
    def directory(self) -> Path | None:
        """The job's directory (spec, keys, agents' addresses, output), once submitted."""
        return self._dir.path if self._dir else None

    @property
    def output_file(self) -> Path | None:
        """Where the batch script's output goes, once submitted."""
        if self._dir is None or self.job_id is None:
            return None
        return self._dir.output_file(self.job_id)

    def apply(self, *, script: Sequence[str] = ()) -> SlurmJob:
        """Submit the job (once; later calls do nothing). With `script`, the job runs that
        client command line on its first node and ends when it does (batch mode)."""
        if self._spec is not None:
            return self
        self._dir = JobDir.create(self.name, self._root)
        spec = JobSpec(
            name=self.name,
            meshes=self.meshes,
            persistent=self.persistent or bool(script),
            keys=self._job_keys(self._dir),
            python=self._python,
            listen_host=self._listen_host,
            script=list(script),
            notice_signal=self._notice_signal,
        )
        self._dir.write_spec(spec)
        try:
            job_id = self._submit(self._dir, outlives_client=spec.persistent or self._requeue)
        except BaseException:
            shutil.rmtree(self._dir.path, ignore_errors=True)  # nothing of it runs
            self._dir = None
            raise
        self._spec = replace(spec, job_id=job_id)
        self._dir.write_spec(self._spec)
        if not spec.persistent:
            self._reaper = start_reaper(job_id)
            atexit.register(self._cancel_at_exit)
        self._report(f"submitted SLURM job {job_id} ({self.name}), output in {self.output_file}")
        return self

    def state(
        self, timeout_s: float | None = None, *, cached_path: str | os.PathLike[str] | None = None
    ) -> JobState:
        """The job's host meshes, submitting it first if needed, once every node's agent
        answers (bounded by `timeout_s`, default `start_timeout_s`): SlurmError quoting SLURM
        if the job cannot start or ends, TimeoutError if it is not up in time. With
        `cached_path`, a persistent job reuses the job cached there by an earlier run if it
        still runs and asked for the same, and caches itself there otherwise."""
        if cached_path is not None:
            self._use_cache(Path(cached_path))
        self.apply()
        assert self._spec is not None and self._spec.job_id is not None and self._dir is not None
        if self._state is not None and self._still_current(self._state):
            return self._state
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        use_curve_keys(self._spec.keys)
        current_session()  # this client's runtime starts while the agents do, not after them
        nodes, addresses, restarts = AgentsWait(
            self._spec.job_id, self.name, self._dir, sum(self.meshes.values()), self._report
        ).until(deadline)
        listen_host = client_host(addresses.values())
        meshes, node_names = {}, {}
        start = 0
        for mesh_name, count in self.meshes.items():
            chosen = nodes[start : start + count]
            start += count
            meshes[mesh_name] = attach(
                [addresses[node] for node in chosen], listen_host=listen_host
            )
            node_names[mesh_name] = tuple(chosen)
        for host_mesh in meshes.values():
            host_mesh.wait_for_agents(max(1.0, deadline - time.monotonic()))
        self._report(f"SLURM job {self._spec.job_id}: all {len(nodes)} agents answer")
        self._state = JobState(self._spec.job_id, meshes, node_names, restarts, addresses)
        return self._state

    def cancel(self, wait_s: float = 30.0) -> None:
        """End the job (``scancel``): its agents and every proc on them stop. Waits up to
        `wait_s` until SLURM has finished it (its nodes are free again)."""
        for host_mesh in self._state.meshes.values() if self._state else ():
            host_mesh.shutdown()  # this client knows they stop on purpose: no "lost" agents
        if self.job_id is not None:
            cancel(self.job_id)
            deadline = time.monotonic() + wait_s
            while self.slurm_state() in LIVE_JOB_STATES and time.monotonic() < deadline:
                time.sleep(0.1)
        if self._reaper is not None:
            self._reaper.terminate()
            self._reaper.wait()
            self._reaper = None
        if self._salloc is not None:  # it ends with the job's batch process, once the job ends
            try:
                self._salloc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                self._salloc.kill()  # the job is cancelled: it has nothing left to release
                self._salloc.wait()
            self._salloc = None
        self._state = None

    kill = cancel  # Monarch's name

    def restart_agent(self, node: str, timeout_s: float = 60.0) -> subprocess.Popen[bytes]:
        """Start the host agent of `node` again, in a new job step at the address it had (a
        node manager bringing a lost node back): host meshes holding it stay valid. Returns
        the step's ``srun`` once the agent listens (ending the srun ends the step)."""
        if self._dir is None or self.job_id is None:
            raise RuntimeError(f"{self!r} is not submitted: call apply() or state() first")
        return restart_agent_step(self._dir, self.job_id, node, timeout_s)

    def slurm_state(self) -> str:
        """SLURM's state of the job (``PENDING``, ``RUNNING``, ...; ``UNKNOWN`` once forgotten)."""
        if self.job_id is None:
            return "NOT_SUBMITTED"
        record = job_record(self.job_id)
        return record.get("JobState", "UNKNOWN") if record else "UNKNOWN"

    def __repr__(self) -> str:
        return f"<SlurmJob {self.name} id={self.job_id} meshes={self.meshes}>"

    # -- internals ------------------------------------------------------------------------------

    def _submit(self, job_dir: JobDir, outlives_client: bool) -> str:
        """Submit the job; its id. One the client's exit cancels starts at once (salloc,
        `job._salloc`) unless salloc refuses one of its options; others are batch jobs."""
        if not outlives_client:
            try:
                job_id, self._salloc = allocate(salloc_arguments(self._sbatch_args), job_dir)
                return job_id
            except SallocRefusedOption as refused:
                (job_dir.path / "salloc.out").unlink(missing_ok=True)
                self._report(f"submitting a batch job instead: {refused}")
        job_dir.batch_script.write_text(batch_script(self._python, job_dir.path))
        return submit(
            [*self._sbatch_args, f"--output={job_dir.output_file()}"], str(job_dir.batch_script)
        )

    def _job_keys(self, job_dir: JobDir) -> str:
        """The CURVE keys the job's agents use: this client's own if it has some (a process
        uses one key pair), else a pair made for the job in its private directory."""
        own = transport_settings().curve_keys
        if own:
            return str(Path(own).absolute())
        keys = job_dir.path / "keys"
        CurveKeys.create(keys)
        return str(keys)

    def _no_longer_runs(self, state: str) -> str:
        record = (job_record(self.job_id) if self.job_id else None) or {}
        ended = f"it ended as {state} (reason {pending_reason(record)}, exit code " + (
            f"{record.get('ExitCode', '?')})" if record else ""
        )
        if not record:
            ended = "SLURM no longer knows it (it ended a while ago)"
        return (
            f"cannot attach to SLURM job {self.job_id} ({self.name}): {ended}; its directory is "
            f"{self.directory}; start a new SlurmJob instead"
        )

    def _still_current(self, state: JobState) -> bool:
        """Whether the job still runs with the agents `state` was built from (a requeued job
        has new ones)."""
        record = job_record(state.job_id)
        return (
            record is not None
            and record.get("JobState") == "RUNNING"
            and int(record.get("Restarts", "0") or 0) == state.restarts
        )

    def _use_cache(self, path: Path) -> None:
        if not self.persistent:
            raise ValueError(
                "cached_path reuses the job in a later run, so the job must outlive this client: "
                "make it with SlurmJob(..., persistent=True)"
            )
        fingerprint = job_fingerprint(self.name, self.meshes, self._sbatch_args)
        found = live_cached_job(path, fingerprint) if self._spec is None else None
        if found is not None:
            self._dir, self._spec = found, found.read_spec()
            self._report(f"reusing SLURM job {self.job_id} ({self.name}) cached in {path}")
        self.apply()
        assert self.job_id is not None and self.directory is not None
        write_cached_job(path, CachedJob(str(self.directory), self.job_id, fingerprint))

    def _report(self, line: str) -> None:
        if self._progress is not None:
            self._progress(line)

    def _cancel_at_exit(self) -> None:
        with contextlib.suppress(Exception):
            if self._reaper is not None:
                self.cancel()


def find_job(
    job: str | int,
    *,
    job_dir: str | os.PathLike[str] | None = None,
    start_timeout_s: float = 600.0,
    progress: Progress | None = _print_progress,
) -> SlurmJob:
    """The job with SLURM id or name `job` whether or not SLURM still runs it (of several
    with that name, the newest one still queued or running, else the newest)."""
    found = job_dirs_matching(str(job), Path(job_dir) if job_dir is not None else None)
    jobs = [SlurmJob._from_dir(path, start_timeout_s, progress) for path in found]
    return next((each for each in jobs if each.slurm_state() in LIVE_JOB_STATES), jobs[0])


@contextlib.contextmanager
def slurm_job(meshes: Mapping[str, int], **options: object) -> Iterator[JobState]:
    """A `SlurmJob`'s state for one block; the job is cancelled when the block ends."""
    job = SlurmJob(meshes, **options)  # type: ignore[arg-type]
    try:
        yield job.state()
    finally:
        job.cancel()
