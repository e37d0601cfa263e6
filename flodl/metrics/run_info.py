"""What a job is called and how it was launched: names the W&B run, its group and its config."""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flodl.config.host import RankEnv


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
    # Unique to this run, shared by its ranks and restarts (flodl/launcher/run_dir.py: run_uid); checkpoints
    # record it. `run_id` below is W&B's, per run dir.
    uid: str = ""
    # The command line that continues this job from its last checkpoint (printed when it is stopped).
    resume_command: str = ""

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
        resume_command=resume_command(overrides, run_dir),
    )


def resume_command(overrides: list[str], run_dir: Path) -> str:
    """This job again, alone, in its run dir with resume=auto: the launcher's own arguments (torchrun's
    too, when it started this rank), the config flags and the job's overrides."""
    argv = sys.orig_argv
    script = argv.index(sys.argv[0]) if sys.argv[0] in argv else 1
    launcher = argv[:script]
    env = RankEnv.from_environ()
    if env.launched and env.run_id:  # torchrun started this rank
        launcher = _torchrun_argv() or ["torchrun"]
    config_flags = []
    for i, arg in enumerate(sys.argv[1:], start=1):
        flag = arg.split("=")[0]
        if flag in _CONFIG_FLAGS:
            config_flags += [arg] if "=" in arg else sys.argv[i : i + 2]
    kept = [o for o in overrides if o.lstrip("+~").split("=")[0] != "resume"]
    words = [*launcher, sys.argv[0], *config_flags, *kept, f"hydra.run.dir={run_dir}", "resume=auto"]
    return shlex.join(words)


# Hydra's flags that pick the config: a resumed job needs the same.
_CONFIG_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")


def _torchrun_argv() -> list[str] | None:
    """torchrun's command line up to the script, read from its process (this rank's parent)."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    return argv[: argv.index(sys.argv[0])] if sys.argv[0] in argv else None


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
