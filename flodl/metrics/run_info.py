"""What a job is called and how it was launched: names the W&B run, its group and its config."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunInfo:
    run_dir: str
    # The sweep (multirun) this job belongs to, else the run itself.
    group: str
    # Hydra's override dirname (e.g. "policy=async,seed=1"), else the run dir's name.
    name: str
    overrides: list[str] = field(default_factory=list)
    command: str = ""
    git_commit: str | None = None
    # Unique to this run, shared by its ranks and restarts (flodl/run_dir.py: run_uid); checkpoints
    # record it. `run_id` below is W&B's, per run dir.
    uid: str = ""

    @property
    def run_id(self) -> str:
        """Deterministic per run dir, so a restarted job resumes its own W&B run."""
        return hashlib.sha1(str(Path(self.run_dir).resolve()).encode()).hexdigest()[:16]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def from_hydra(run_dir: Path, group: str | None = None) -> RunInfo:
    """Build the job's RunInfo inside @hydra.main (HydraConfig is only available there). `group`:
    `logger.group` (null: the sweep's stamp under multirun, else the run's; the slots launcher passes its
    sweep's to each job, which runs as a single run)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra = HydraConfig.get()
    if group is None:
        multirun = hydra.mode == RunMode.MULTIRUN
        group = "/".join((Path(hydra.sweep.dir) if multirun else run_dir).parts[-2:])
    return RunInfo(
        run_dir=str(run_dir),
        group=group,
        name=hydra.job.override_dirname or run_dir.name,
        overrides=list(hydra.overrides.task),
        command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        git_commit=_git_commit(),
    )


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
