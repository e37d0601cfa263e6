"""`run.json` in the run dir: when the job was launched, trained and exited (Unix times, seconds).

The compare report reads it for each job's real wall time and start-up. Two processes write it, one after
the other: rank 0 (`training_started_at`, `training_ended_at`: its coordinator's run) before it exits, then
the process that launched the job (`launched_at`, `exited_at`). Under torchrun or in one process, rank 0 is
that process.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil

RUN_FILE = "run.json"
# When the previous job of this process (a multirun walked in one process) exited: the next one's launch.
_previous_exit: float | None = None


def launch_time() -> float:
    """When this job was launched: the previous job's exit in this process, else the process's start (under
    torchrun, its agent's start: the agent launched the job)."""
    if _previous_exit is not None:
        return _previous_exit
    process = psutil.Process()
    if os.environ.get("TORCHELASTIC_RUN_ID") and (parent := process.parent()) is not None:
        process = parent
    return process.create_time()


def record(run_dir: Path, **times: float) -> None:
    """Merge `times` into the run dir's run.json."""
    path = run_dir / RUN_FILE
    fields = json.loads(path.read_text()) if path.exists() else {}
    fields.update(times)
    tmp = path.with_name(f".{RUN_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(fields, indent=1) + "\n")
    tmp.replace(path)  # a reader sees the old file or the new one


def record_exit(run_dir: Path, launched_at: float) -> None:
    global _previous_exit
    _previous_exit = time.time()
    record(run_dir, launched_at=launched_at, exited_at=_previous_exit)
