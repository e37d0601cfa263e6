"""`run.json` in the run dir: when the job was launched, trained and exited (Unix times, seconds); and
`sweep.json` in a sweep dir: the sweep's own start-up, which is no job's.

The compare report reads them for each job's real wall time and start-up. Two processes write run.json, one
after the other: rank 0 (`training_started_at`, `training_ended_at`: its coordinator's run) before it exits,
then the process that launched the job (`launched_at`, `exited_at`, and for a job that failed the line its
launcher said, `failed`). Under torchrun or in one process, rank 0
is that process. A process that walks a sweep launches its first job once the sweep has checked its grid
(its interpreter, Hydra and that check are the sweep's start-up), and each later job when the one before
exited.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil

from flodl.config.host import RankEnv

RUN_FILE = "run.json"
# run.json's key for the line a failed job's launcher said (the other keys are times).
FAILED = "failed"
SWEEP_FILE = "sweep.json"
# Set by a launcher that starts each job as its own process (the slots launcher): the moment it launched it,
# on this clock, where the job's process start is known only to the kernel's tick.
LAUNCHED_AT_ENV = "FLODL_LAUNCHED_AT"
# Set by the supervisor as it starts a rank: a spare process (flodl/launcher/spare.py) started long before
# it became the rank.
RANK_STARTED_AT_ENV = "FLODL_RANK_STARTED_AT"
# When this process launches its next job (a multirun walked in one process): the moment its sweep had
# checked the grid, then each job's exit.
_next_launch: float | None = None


def _process_start() -> float:
    """When this process started; under torchrun, its agent's (the agent launched the job)."""
    process = psutil.Process()
    if RankEnv.from_environ().run_id and (parent := process.parent()) is not None:
        process = parent
    return started_at(process)


def started_at(process: psutil.Process) -> float:
    """When `process` started, on time.time()'s clock: psutil's create_time adds its age since boot to a boot
    time it rounds to the second, which can put the start up to a second early against time.time()."""
    since_boot = process.create_time() - psutil.boot_time()
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


def rank_started_at() -> float:
    """When this rank's process was started as the rank."""
    said = os.environ.get(RANK_STARTED_AT_ENV)
    return float(said) if said else started_at(psutil.Process())


def launch_time() -> float:
    """When this job was launched: `_next_launch`, else what its launcher said, else its process start."""
    if _next_launch is not None:
        return _next_launch
    said = os.environ.get(LAUNCHED_AT_ENV)
    return float(said) if said else _process_start()


def sweep_ready(sweep_dir: Path | None) -> None:
    """A sweep has checked its grid (or a later batch of it): its next job is launched now. The first time,
    the sweep's start-up goes to `sweep_dir`'s sweep.json (None: another rank writes it)."""
    global _next_launch
    now = time.time()
    if sweep_dir is not None and _next_launch is None:  # no job launched yet: the sweep's first batch
        _write(sweep_dir / SWEEP_FILE, {"launched_at": _process_start(), "jobs_started_at": now})
    _next_launch = now


def sweep_startup_s(sweep_dir: Path) -> float | None:
    """The sweep's own start-up, before its first job was launched (None: no sweep.json there)."""
    path = sweep_dir / SWEEP_FILE
    if not path.is_file():
        return None
    times = json.loads(path.read_text())
    return times["jobs_started_at"] - times["launched_at"]


def record(run_dir: Path, **fields: float | str) -> None:
    """Merge `fields` (times; a failure's line) into the run dir's run.json."""
    path = run_dir / RUN_FILE
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update(fields)
    _write(path, merged)


def _write(path: Path, fields: dict[str, float | str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(fields, indent=1) + "\n")
    tmp.replace(path)  # a reader sees the old file or the new one


def record_exit(run_dir: Path, launched_at: float, failed: str | None = None) -> None:
    """The job exited; `failed`: the one line its launcher said of its failure (the compare report's why)."""
    global _next_launch
    _next_launch = time.time()
    said = {FAILED: failed} if failed is not None else {}
    record(run_dir, launched_at=launched_at, exited_at=_next_launch, **said)


def read_run(run_dir: Path) -> tuple[dict[str, float], str | None]:
    """The job's times (none for a job that never wrote run.json) and its launcher's failure line, if any."""
    path = run_dir / RUN_FILE
    fields = json.loads(path.read_text()) if path.is_file() else {}
    failed = fields.pop(FAILED, None)
    return fields, failed
