"""Every check that can run before a rank starts, on one composed job: `preflight(cfg)`.

The CLI calls it before Hydra creates the run dir (flodl/launch.py's `Preflight` callback), and a sweep can
call it for each of its jobs. Beyond the pure rules (flodl/config/rules.py) it reads what costs little:
the task's `_target_`s bound against their signatures (nothing is built but the model on the meta device),
the paths the run will write, and the Hydra settings of the job (the checkpoint `resume` names is checked by
flodl/launch.py once the run has its identity, still before any rank starts).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, get_type_hints

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from flodl.config.host import HostFacts, RankEnv, stage_dir_of
from flodl.config.rules import ConfigError, validate
from flodl.config.schema import FlodlConfig, to_config
from flodl.config.targets import TASK_TARGETS, list_target_problems, locate, task_target_problems

log = logging.getLogger("flodl")

# Hydra's own keys in a `_target_` node: not arguments of the target.
_HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")


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
            k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
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
    # The task node's container: a dict keyed by names (the stubs allow any DictConfig key, or a list).
    problems += _target_problems(typed, targets)  # type: ignore[arg-type]
    if run_dir is None and hydra is not None and hydra.run.dir:
        run_dir = Path(hydra.run.dir)
    problems += _path_problems(typed, run_dir)
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


def _target_problems(typed: FlodlConfig, task: Mapping[str, Any]) -> list[str]:
    # Each target imports (config/targets.py), then its arguments bind to its signature.
    problems = task_target_problems(typed) + list(list_target_problems("callbacks", typed.callbacks))
    for name in TASK_TARGETS:
        node = task.get(name)
        if node is not None:
            problems += _bind_problems(node, f"task.{name}")
    if not problems:  # only a model whose arguments bind is built
        problems += _capacity_problems(task["model"])
    optimizer = task.get("optimizer")
    lr = optimizer.get("lr") if isinstance(optimizer, Mapping) else None
    if isinstance(lr, (int, float)) and not (math.isfinite(lr) and lr > 0):
        problems.append(f"task.optimizer.lr={lr!r}: must be finite and > 0 (a zero rate trains nothing)")
    return problems


def _bind_problems(node: Any, key: str) -> list[str]:
    """The node's arguments bound to its target's signature (partially for `_partial_`), nested targets too.
    A target that does not import is named by config/targets.py (or by the rank that builds it, if nested)."""
    if not isinstance(node, Mapping) or "_target_" not in node:
        return [f"{key}={node!r}: must be a `_target_` config (a mapping with _target_ and its arguments)"]
    problems: list[str] = []
    kwargs = {k: v for k, v in node.items() if k not in _HYDRA_KEYS}
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
        problems.append(f"{key}: {target}{signature} does not take these arguments ({err}); {_args(kwargs)}")
    return problems


def _args(kwargs: Mapping[str, Any]) -> str:
    return "given " + (", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "no arguments")


def _capacity_problems(model: Mapping[str, Any]) -> list[str]:
    """Built on the meta device (no memory, no weights): a model whose trainable tensors hold no element."""
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about zero-element tensors: reported below
            built = instantiate(model)
    except Exception as err:
        return [f"task.model: building it failed ({type(err).__name__}: {err})"]
    if not isinstance(built, torch.nn.Module):
        return [f"task.model: expected an nn.Module, got {type(built).__name__}"]
    params = [(name, p) for name, p in built.named_parameters() if p.requires_grad]
    empty = [f"{name} {tuple(p.shape)}" for name, p in params if p.numel() == 0]
    if not params or empty:
        what = (
            f"parameters with a zero-size dimension: {', '.join(empty)}"
            if empty
            else "no trainable parameter"
        )
        return [f"task.model: has {what}; check its width arguments ({_args(model_args(model))})"]
    return []


def model_args(model: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in model.items() if k not in _HYDRA_KEYS}


def _path_problems(cfg: FlodlConfig, run_dir: Path | None) -> Iterator[str]:
    paths = [("save_path", cfg.save_path), ("hydra.run.dir", None if run_dir is None else str(run_dir))]
    if cfg.disk_stage_gb > 0:
        paths.append(("disk_stage_dir", stage_dir_of(cfg.disk_stage_dir)))
    for key, path in paths:
        if path and not _writable(Path(path)):
            yield f"{key}={path!r}: cannot be written by this user (no write permission on it or its parent)"


def _writable(path: Path) -> bool:
    """The path, or its nearest existing ancestor (it will be created), is a dir this user can write."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _resident(train_data: Any) -> bool:
    """The train data is known to be held in memory: its target is, or is annotated to return, a dataset class
    that says so (`resident = True`)."""
    try:
        func = locate(train_data["_target_"])
        made = func if isinstance(func, type) else get_type_hints(func).get("return")
    except Exception:  # not importable or its annotations do not resolve: not known to be resident
        return False
    return bool(getattr(made, "resident", False))
