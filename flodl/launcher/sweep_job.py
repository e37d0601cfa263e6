"""A job of a Hydra multirun, as its sweeper sees it.

- It returns the run's objective (flodl/launcher/objective.py): what Optuna, Ax or Nevergrad optimize.
- Its failure is an exception Hydra records (a failed trial), never an exit: SystemExit escapes Hydra's job
  runner and ends the whole sweep, whatever the sweeper's tolerance of failed trials.
- Under a sweeper that checks no job before it runs (every one but flodl's, which checks each), what every
  job shares is checked before the first: a problem of the sweep's config that names none of the keys it
  varies would fail every job alike, so the sweep stops with exit 2 instead.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

from omegaconf import DictConfig, open_dict

from flodl.config.rules import ConfigError
from flodl.config.sweep import FlodlSweeperConf
from flodl.launcher.objective import NoObjective, read_objective
from flodl.preflight.checks import preflight

__all__ = ["JobFailed", "NoObjective", "in_multirun", "objective", "shared_problems"]


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
