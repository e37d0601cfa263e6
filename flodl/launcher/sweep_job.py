"""A job of a Hydra multirun, as its sweeper sees it.

- It returns the run's objective (flodl/launcher/objective.py): what Optuna, Ax or Nevergrad optimize.
- Its failure is an exception Hydra records (a failed trial), never an exit: SystemExit escapes Hydra's job
  runner and ends the whole sweep, whatever the sweeper's tolerance of failed trials.
- Under a sweeper that checks no job before it runs (every one but flodl's, which checks each), what every
  job shares is checked before the first: a problem of the sweep's config that names none of the keys it
  varies would fail every job alike, so the sweep stops with exit 2 instead.
- Under torchrun every rank walks the sweep. A grid (flodl's sweeper, Hydra's basic one) is the same on
  every rank; a sweeper that draws its trials (Optuna, Ax, Nevergrad) draws them on rank 0 alone: rank 0
  publishes each job's overrides in torchrun's store as it starts, and every other rank's sweeper is replaced
  by one that runs those jobs (`hydra_plugins.flodl_sweeper.RankZerosTrials`), so the ranks never compose
  different trials, whatever the sampler, its seed or its history.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict, read_write

from flodl.config.host import RankEnv
from flodl.config.rules import ConfigError
from flodl.config.sweep import FlodlSweeperConf
from flodl.launcher.cluster_env import adopt_scheduler_environ
from flodl.launcher.objective import NoObjective, read_objective
from flodl.launcher.run_dir import agent_store, launch_key
from flodl.links.group import publish_json, read_json
from flodl.preflight.checks import preflight

__all__ = [
    "JobFailed",
    "NoObjective",
    "drawn_on_rank_0",
    "follow_rank_0",
    "in_multirun",
    "objective",
    "publish_job",
    "rank_0s_jobs",
    "shared_problems",
]

# Sweepers whose jobs every rank composes alike from the command line: the others draw their trials.
_GRIDS = (FlodlSweeperConf._target_, "hydra._internal.core_plugins.basic_sweeper.BasicSweeper")
_FOLLOWER = "hydra_plugins.flodl_sweeper.RankZerosTrials"


class JobFailed(RuntimeError):
    """A sweep's job failed (its one line); the sweeper counts it as a failed trial."""


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def objective(cfg: DictConfig, run_dir: Path) -> float:
    evaluates = cfg.eval_every > 0 and cfg.task.eval_data is not None
    return read_objective(run_dir, cfg.objective, evaluates)


def varied_keys(config: DictConfig) -> set[str]:
    """The keys a sweep varies: its sweep overrides (`a=1,2`, `interval(...)`, `choice(...)`) and its
    sweeper's `params`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides([str(o) for o in config.hydra.overrides.task])
    params = config.hydra.sweeper.get("params") or {}
    return {o.key_or_group for o in overrides if o.is_sweep_override()} | {str(key) for key in params}


def shared_problems(config: DictConfig) -> list[str]:
    """The problems of the sweep's own config (its fixed overrides) that name no key the sweep varies;
    none under flodl's sweeper, which checks every job itself."""
    if config.hydra.sweeper.get("_target_") == FlodlSweeperConf._target_:
        return []
    cfg = copy.deepcopy(config)
    with open_dict(cfg):
        del cfg["hydra"]  # its dirs resolve to new stamps
    try:
        preflight(cfg)
    except ConfigError as err:
        return naming_none_of(err.problems, varied_keys(config))
    return []


def naming_none_of(problems: list[str], keys: set[str]) -> list[str]:
    """The problems whose text names none of `keys` (as a whole dotted key: `lr` is not `task.optimizer.lr`'s
    last part, nor `lr_scale_ratio`)."""
    names = [re.compile(rf"(?<![\w.]){re.escape(key)}(?!\w|\.\w)") for key in keys]
    return [problem for problem in problems if not any(name.search(problem) for name in names)]


def drawn_on_rank_0(config: DictConfig) -> bool:
    """Under torchrun (several ranks walking the sweep), whether the sweep's trials are drawn (a sweeper that
    is no grid): rank 0 draws them and the other ranks run its jobs."""
    adopt_scheduler_environ()  # ranks a scheduler started walk the sweep too
    env = RankEnv.from_environ()
    return env.launched and env.world_size > 1 and config.hydra.sweeper.get("_target_") not in _GRIDS


def follow_rank_0(config: DictConfig) -> None:
    """Before Hydra builds the sweeper from `config`: every rank but 0 gets the one that runs rank 0's
    jobs. Refused where the ranks share no store before a job's group (ranks a scheduler started)."""
    if agent_store() is None:
        sweeper = config.hydra.sweeper.get("_target_")
        raise ConfigError(
            [
                f"hydra.sweeper: {sweeper} draws each trial, and ranks started without torchrun share no "
                "store to hand rank 0's draws to the others: start them with torchrun, or sweep with "
                "launch.nproc_per_node (each trial starts its own ranks)"
            ]
        )
    if RankEnv.from_environ().rank != 0:
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.sweeper = {"_target_": _FOLLOWER}


def _job_key(config: DictConfig, num: int) -> str:
    env = RankEnv.from_environ()
    return launch_key(f"sweep/{config.hydra.sweep.dir}/{env.restart_count}/{num}")


def publish_job(config: DictConfig, num: int, overrides: list[str] | None) -> None:
    """Rank 0: job `num` of the sweep runs with `overrides` (None: the sweep ended before it)."""
    exchange: Any = agent_store()
    publish_json(exchange, _job_key(config, num), overrides)


def rank_0s_jobs(config: DictConfig) -> Iterator[tuple[int, list[str]]]:
    """Each job rank 0 runs (its number and overrides), as it starts, until its sweep ends; a wait for the
    next is bounded by `launch.timeout_s`, as a collective is."""
    exchange: Any = agent_store()
    exchange.set_timeout(timedelta(seconds=float(config.launch.timeout_s)))
    num = 0
    while (overrides := read_json(exchange, _job_key(config, num))) is not None:
        yield num, overrides
        num += 1
