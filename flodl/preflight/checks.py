"""Every check that can run before a rank starts, on one composed job: `preflight(cfg)`.

The CLI calls it before Hydra creates the run dir (flodl/launcher/launch.py's `Preflight` callback), and a
sweep can call it for each of its jobs. Beyond the pure rules (flodl/config/rules/) it reads what costs
little: the task's `_target_`s bound against their signatures, then its parts built once
(flodl/preflight/task_probe.py: the datasets, the model, optimizer and scheduler on the meta device, eval_fn
on one batch), the paths the run will write (a dir made and removed in each), W&B's API key, the checkpoint
`resume` names, and the Hydra settings of the job.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, get_type_hints

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flodl.checkpoints.disk import CheckpointError
from flodl.checkpoints.identity import run_identity
from flodl.config.host import HostFacts, RankEnv, stage_dir_of
from flodl.config.rules import ConfigError, validate
from flodl.config.schema import FlodlConfig, to_config
from flodl.config.targets import TASK_TARGETS, list_target_problems, locate, task_target_problems
from flodl.job.resume import choose_checkpoint
from flodl.job.settings import resume_settings, wandb_settings
from flodl.metrics.wandb_sink import start_problem
from flodl.preflight.plan import state_fit_problems
from flodl.preflight.task_probe import HYDRA_KEYS, given, task_problems
from flodl.worker.task_setup import lr_scale_factor

log = logging.getLogger("flodl")

# The largest float32: an optimizer's learning rate meets the parameters in their precision.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def preflight(cfg: DictConfig, run_dir: Path | None = None) -> tuple[FlodlConfig, HostFacts]:
    """The typed config of one job and the host facts it was checked on, or ConfigError listing every problem
    found before any rank starts.

    `cfg` is the composed job config, with its `hydra` node when there is one; `run_dir` the job's output dir
    (None: read from `hydra.run.dir`)."""
    hydra = cfg.get("hydra") if isinstance(cfg, DictConfig) else None
    problems = list(_hydra_problems(cfg, hydra)) if hydra is not None else []
    try:
        # Plain values: a structured node merged as it is keeps a key Hydra's `+` forced into it.
        data = {
            str(k): OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
            for k, v in cfg.items()
            if k != "hydra"
        }
        typed = to_config(data)
    except OmegaConfBaseException as err:
        raise ConfigError([*problems, omegaconf_problem(err)]) from None
    host = HostFacts.probe(typed.launch.nproc_per_node, typed.disk_stage_dir)
    try:
        validate(typed, host)
    except ConfigError as err:
        problems += err.problems
    targets = OmegaConf.to_container(OmegaConf.structured(typed).task, resolve=True)
    # The task node's container: a dict keyed by names (the stubs allow any DictConfig key, or a list). Its
    # parts are built (beyond the model) only on values the rules accept.
    problems += _target_problems(typed, targets, host.world_size, not problems)  # type: ignore[arg-type]
    if not problems:  # the model's training state fits each rank's device, sharded as shard_group says
        problems += state_fit_problems(typed, host)
    if run_dir is None and hydra is not None and hydra.run.dir:
        run_dir = Path(hydra.run.dir)
    problems += _path_problems(typed, run_dir)
    problems += _logger_problems(typed)
    if not problems and run_dir is not None:
        problems += _resume_problems(typed, data, host, run_dir)
    if problems:
        raise ConfigError(problems)
    return typed, host


def warn_of_idle_disk_tier(typed: FlodlConfig) -> None:
    """disk_stage_gb on data already in memory stays accepted (a shared config may set it): one warning."""
    if typed.disk_stage_gb > 0 and RankEnv.from_environ().rank == 0 and _resident(typed.task.train_data):
        log.warning(
            "disk_stage_gb=%g: task.train_data is already in memory, so the disk tier has nothing to stage",
            typed.disk_stage_gb,
        )


def omegaconf_problem(err: OmegaConfBaseException) -> str:
    """`key: reason` for an OmegaConf error (an unknown key, a value of the wrong type)."""
    key = getattr(err, "full_key", None) or "config"
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    return f"{key}: {reason}"


def _hydra_problems(cfg: DictConfig, hydra: DictConfig) -> Iterator[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    if hydra.mode == RunMode.MULTIRUN:
        return
    if not str(hydra.run.dir).strip():
        yield "hydra.run.dir='': is empty, so the run would write into the current dir; name a dir"
    for override in OverridesParser.create().parse_overrides(list(hydra.overrides.task)):
        key = override.key_or_group
        # `policy=[sync,async]` selects both options of the group, merged into one run (the last wins).
        if isinstance(override.value(), list) and not OmegaConf.is_list(OmegaConf.select(cfg, key)):
            value = override.get_value_element_as_str()
            yield f"{key}={value}: a list of options merges them into one run; sweep them with -m {key}=a,b"


def _target_problems(
    typed: FlodlConfig, task: Mapping[str, Any], world_size: int, rules_passed: bool
) -> list[str]:
    # Each target imports (config/targets.py), then its arguments bind to its signature.
    problems = task_target_problems(typed) + list(list_target_problems("callbacks", typed.callbacks))
    for name in TASK_TARGETS:
        node = task.get(name)
        if node is not None:
            problems += _bind_problems(node, f"task.{name}")
    optimizer = task.get("optimizer")
    lr = optimizer.get("lr") if isinstance(optimizer, Mapping) else None
    lr_problems = _lr_problems(typed, lr, world_size) if isinstance(lr, (int, float)) else []
    if not problems:  # only parts whose arguments bind are built
        problems += task_problems(typed, task, world_size, whole=rules_passed and not lr_problems)
    return problems + lr_problems


def _lr_problems(typed: FlodlConfig, lr: float, world_size: int) -> list[str]:
    if not (math.isfinite(lr) and lr > 0):
        return [f"task.optimizer.lr={lr!r}: must be finite and > 0 (a zero rate trains nothing)"]
    factor = lr_scale_factor(world_size, typed.lr_scale_ratio)
    if lr * factor <= _FLOAT32_MAX:
        return []
    fits = f"beyond a float32's {_FLOAT32_MAX:.3g}, where the optimizer meets the parameters"
    if factor == 1:
        return [f"task.optimizer.lr={lr!r}: is {fits}"]
    return [
        f"lr_scale_ratio={typed.lr_scale_ratio!r}: scales task.optimizer.lr={lr!r} by {factor:g} on "
        f"{world_size} ranks, to {lr * factor:g}, {fits}; linear scaling is lr_scale_ratio=1"
    ]


def _bind_problems(node: Any, key: str) -> list[str]:
    """The node's arguments bound to its target's signature (partially for `_partial_`), nested targets too.
    A target that does not import is named by config/targets.py (or by the rank that builds it, if nested)."""
    if not isinstance(node, Mapping) or "_target_" not in node:
        return [f"{key}={node!r}: must be a `_target_` config (a mapping with _target_ and its arguments)"]
    problems: list[str] = []
    kwargs = {k: v for k, v in node.items() if k not in HYDRA_KEYS}
    for arg, value in kwargs.items():
        if isinstance(value, Mapping) and "_target_" in value:
            problems += _bind_problems(value, f"{key}.{arg}")
    target = node["_target_"]
    try:
        # A target that is no callable raises TypeError, as a builtin without a signature does.
        signature = inspect.signature(locate(target))  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin without a signature: nothing to bind against
        return problems
    except Exception:  # does not import: named by config/targets.py's check
        return problems
    bind = signature.bind_partial if node.get("_partial_") else signature.bind
    try:
        bind(*node.get("_args_", ()), **kwargs)
    except TypeError as err:
        problems.append(f"{key}: {target}{signature} does not take these arguments ({err}); {given(node)}")
    return problems


def _path_problems(cfg: FlodlConfig, run_dir: Path | None) -> Iterator[str]:
    if cfg.resume not in ("auto", "never") and not os.path.isdir(cfg.resume):
        yield (
            f"resume={cfg.resume!r}: must be auto, never, or an existing checkpoint dir "
            "(checkpoints/epoch-NNNNNN) or run dir"
        )
    paths = [("save_path", cfg.save_path), ("hydra.run.dir", None if run_dir is None else str(run_dir))]
    if cfg.disk_stage_gb > 0:
        paths.append(("disk_stage_dir", stage_dir_of(cfg.disk_stage_dir)))
    for key, path in paths:
        why = _unwritable(Path(path)) if path else None
        if why is not None:
            yield f"{key}={path!r}: cannot be written by this user ({why})"


def _unwritable(path: Path) -> str | None:
    """Why the path cannot be made a dir of this run's: tried in it, or in its nearest existing ancestor
    (it will be created), with a dir made and removed (permissions alone do not say it for root, a
    read-only mount or /proc)."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    if not path.is_dir():
        return f"{path} is not a dir"
    try:
        Path(tempfile.mkdtemp(prefix=".flodl-write-check-", dir=path)).rmdir()
    except OSError as err:
        return f"making a dir in {path} failed: {err.strerror or err}"
    return None


def _logger_problems(cfg: FlodlConfig) -> list[str]:
    """W&B that must start (logger.required) and would be refused at once."""
    if cfg.logger.name != "wandb" or not cfg.logger.required:
        return []
    why = start_problem(wandb_settings(cfg))
    if why is None:
        return []
    return [
        f"logger=wandb: {why}; log in (`wandb login`, or WANDB_API_KEY), run W&B offline "
        "(logger.mode=offline), or train without it (logger.required=false)"
    ]


def _resume_problems(cfg: FlodlConfig, config: dict[str, Any], host: HostFacts, run_dir: Path) -> list[str]:
    """The checkpoint `resume` names, checked against this job. Not for torchrun's ranks: the ranks check it
    together (a restart's checkpoint is its own run's, by the uid the ranks agree on)."""
    if RankEnv.from_environ().launched:
        return []
    run = run_identity(config, uid="")
    try:
        choose_checkpoint(resume_settings(cfg, run_dir, run), host.world_size)
    except CheckpointError as err:
        return [f"resume={cfg.resume!r}: {err}"]
    return []


def _resident(train_data: Any) -> bool:
    """The train data is known to be held in memory: its target is, or is annotated to return, a dataset class
    that says so (`resident = True`)."""
    try:
        func = locate(train_data["_target_"])
        made = func if isinstance(func, type) else get_type_hints(func).get("return")
    except Exception:  # not importable or its annotations do not resolve: not known to be resident
        return False
    return bool(getattr(made, "resident", False))
