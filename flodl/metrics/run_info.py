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
    # The overrides its sweep varies (e.g. "policy=async,seed=1"), else the run dir's name.
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
    multirun = hydra.mode == RunMode.MULTIRUN
    # A job the slots launcher started runs as a single run in its sweep's dir.
    sweep = Path(hydra.sweep.dir) if multirun else run_dir.parent
    if group is None:
        group = "/".join((sweep if multirun else run_dir).parts[-2:])
    overrides = list(hydra.overrides.task)
    varying = sweep_keys(sweep / "multirun.yaml")
    return RunInfo(
        run_dir=str(run_dir),
        group=group,
        name=job_name(overrides, varying) or run_dir.name,
        overrides=overrides,
        command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        git_commit=_git_commit(Path(hydra.runtime.cwd)),
    )


def sweep_keys(multirun_yaml: Path) -> set[str]:
    """The keys a sweep varies: its command line's sweep overrides and `hydra.sweeper.params`, as the
    sweeper saved them in the sweep dir's multirun.yaml (every launcher's jobs can read it there)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    if not multirun_yaml.is_file():
        return set()
    hydra = OmegaConf.load(multirun_yaml).hydra
    params = hydra.sweeper.get("params") or {}
    overrides = [*hydra.overrides.task, *(f"{key}={value}" for key, value in params.items())]
    parsed = OverridesParser.create().parse_overrides(overrides)
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


def job_name(overrides: list[str], varying: set[str]) -> str:
    """The job's overrides of the keys its sweep varies (`policy=async,seed=1`); never logger/launch/hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    named = []
    for override, parsed in zip(overrides, OverridesParser.create().parse_overrides(overrides), strict=True):
        key = parsed.key_or_group
        if key in varying and key.split(".")[0].split("/")[0] not in _UNNAMED:
            named.append(override.lstrip("+~"))
    return ",".join(named)


# Where and how a job runs, not what it trains: never part of its name.
_UNNAMED = ("logger", "launch", "hydra")


def _git_commit(cwd: Path) -> str | None:
    """The commit of the repository the user ran from (their project, not flodl's)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
