"""The job cache of ``state(cached_path=...)``: the next run of a script reuses the running job.

A script that calls ``job.state(cached_path=".meshvisor/job.json")`` gets, in its next run, the
same SLURM job if that job still runs and was made from the same specification (Monarch's job
cache, there a pickle). Here the file is JSON, never unpickled, written private (0600): the
job's directory, its SLURM id and a fingerprint of its specification.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from job._formats import LIVE_JOB_STATES
from job._jobdir import JobDir
from job._scheduler import job_record


@dataclass(frozen=True)
class CachedJob:
    """What a job cache file holds."""

    directory: str
    job_id: str
    fingerprint: str


def job_fingerprint(name: str, meshes: Mapping[str, int], arguments: Sequence[str]) -> str:
    """A digest of what a job asks for: a cached job is reused only for the same request."""
    request = json.dumps([name, dict(meshes), list(arguments)], sort_keys=True)
    return hashlib.sha256(request.encode()).hexdigest()


def read_cached_job(path: Path) -> CachedJob | None:
    """The job cached in `path`, or None if there is no such file; ValueError naming the file
    if it is not a job cache."""
    try:
        data = json.loads(path.read_text())
        return CachedJob(**{key: str(data[key]) for key in ("directory", "job_id", "fingerprint")})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ValueError(
            f"{path} is not a meshvisor job cache ({error!r}); delete it or pass another "
            "cached_path"
        ) from None


def live_cached_job(path: Path, fingerprint: str) -> JobDir | None:
    """The directory of the job cached in `path` if SLURM still runs it and it was made with
    `fingerprint`; None otherwise (no file, another request, a job that ended)."""
    cached = read_cached_job(path)
    if cached is None or cached.fingerprint != fingerprint:
        return None
    record = job_record(cached.job_id) or {}
    if record.get("JobState") not in LIVE_JOB_STATES or not Path(cached.directory).is_dir():
        return None
    return JobDir(Path(cached.directory))


def write_cached_job(path: Path, cached: CachedJob) -> None:
    """Write `cached` to `path` atomically, private to the user from creation."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(asdict(cached), handle)
    os.replace(temporary, path)
