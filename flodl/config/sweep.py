"""The grid check of a multirun: its sweeper's config, the block naming invalid jobs, and `skipped.json`.

The sweeper itself lives in `hydra_plugins/flodl_sweeper` (Hydra only loads sweepers from that namespace);
`python -m flodl.metrics.compare` reads the skipped list back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SKIPPED_FILE = "skipped.json"


@dataclass
class FlodlSweeperConf:
    _target_: str = "hydra_plugins.flodl_sweeper.FlodlSweeper"
    # Jobs handed to the launcher at a time (null: all), as Hydra's basic sweeper.
    max_batch_size: int | None = None
    params: dict[str, str] = field(default_factory=dict)
    # Run the jobs that pass the check and list the others in the console and in `skipped.json`;
    # false: an invalid job stops the sweep before any job trains.
    skip_invalid: bool = False


@dataclass
class CheckedJob:
    job: int  # its place in the grid, as Hydra would have numbered it
    overrides: list[str]
    problems: list[str]  # the rules it breaks (none: valid)


def grid_batches(checked: list[CheckedJob], max_batch_size: int | None) -> list[tuple[int, list[CheckedJob]]]:
    """The valid jobs in batches of at most `max_batch_size` (None: no limit), each a run of jobs next to
    each other in the grid with the place of its first: a launcher numbers a batch's jobs on from there, so
    every job dir is named by the job's place in the grid and a skipped job's number is no dir's."""
    batches: list[tuple[int, list[CheckedJob]]] = []
    for job in checked:
        if job.problems:
            continue
        if batches:
            _, jobs = batches[-1]
            if jobs[-1].job == job.job - 1 and (max_batch_size is None or len(jobs) < max_batch_size):
                jobs.append(job)
                continue
        batches.append((job.job, [job]))
    return batches


def invalid_block(invalid: list[CheckedJob], total: int) -> str:
    """One block: each invalid job, its overrides and the rules it breaks."""
    lines = [f"{len(invalid)} of {total} sweep jobs are invalid:"]
    for job in invalid:
        lines.append(f"  job {job.job} ({' '.join(job.overrides)}): {'; '.join(job.problems)}")
    return "\n".join(lines)


def write_skipped(sweep_dir: Path, invalid: list[CheckedJob]) -> Path:
    path = sweep_dir / SKIPPED_FILE
    path.write_text(json.dumps([vars(job) for job in invalid], indent=1) + "\n")
    return path


def read_skipped(sweep_dir: Path) -> list[CheckedJob]:
    """The jobs the sweep skipped as invalid (none when it skipped nothing)."""
    path = sweep_dir / SKIPPED_FILE
    entries: list[dict[str, Any]] = json.loads(path.read_text()) if path.is_file() else []
    return [CheckedJob(**entry) for entry in entries]
