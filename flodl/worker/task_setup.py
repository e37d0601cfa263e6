"""Instantiate a task's parts (model, data, loss, optimizer, scheduler) for one rank."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate
from torch import Tensor, nn
from torch.utils.data import default_collate

from flodl.config.targets import batch_dataset_problems
from flodl.data.augment import Transform
from flodl.data.dataset import as_dataset, check_purity, is_batch_dataset
from flodl.data.streams import seed_rank_streams
from flodl.worker.float8 import convert_to_float8

# The batch: a BatchDataSet's list[Tensor], or what collate_fn made of a map-style Dataset's samples.
LossFn = Callable[[nn.Module, Any], Tensor]
EvalFn = Callable[[nn.Module, Any], dict[str, Tensor]]


@dataclass
class TaskParts:
    model: nn.Module
    # A BatchDataSet, a map-style Dataset (flodl/data/dataset.py) or a stream (flodl/data/stream.py).
    train_data: Any
    eval_data: Any | None
    loss_fn: LossFn
    eval_fn: EvalFn | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    # (batch, keys) -> batch: makes each augment view different (flodl/data/augment.py); None: raw batches.
    transform: Transform | None = None
    # Builds a map-style Dataset's batch from its samples.
    collate: Callable[[list[Any]], Any] = default_collate
    # Whether the training data's reads may be cached (task.cacheable; flodl/data/dataset.py).
    cacheable: bool = True


def lr_scale_factor(world_size: int, lr_scale_ratio: float) -> float:
    """Goyal et al. linear scaling: 1 + (world_size - 1) * ratio (1.0 = full linear scaling)."""
    return 1.0 + (world_size - 1) * lr_scale_ratio


@dataclass(frozen=True)
class TaskSettings:
    """What building a task reads of the run's config (mapped once, by flodl/job/assembly.py)."""

    # The task's Hydra `_target_` nodes as plain data, by key (model, train_data, loss, ...; None: absent).
    targets: Mapping[str, Any]
    seed: int
    lr_scale_ratio: float
    # debug.check_purity: read a few train samples twice and refuse cached data that differs.
    check_purity: bool
    # DataLoader worker processes (refused for a BatchDataSet).
    num_workers: int = 0
    # fp8: the model's linear layers are converted to float8 matmuls (flodl/worker/float8.py) when built.
    precision: str = "fp32"


def build_task(settings: TaskSettings, device: torch.device, world_size: int, rank: int = 0) -> TaskParts:
    """The task's parts for `rank`; afterwards its generators draw the rank's own streams."""
    task = settings.targets
    # Same seed on every rank: identical initial weights even before DDP broadcasts rank 0's.
    torch.manual_seed(settings.seed)
    model = _built(task["model"], "task.model", nn.Module).to(device)
    if settings.precision == "fp8":
        # Before anything holds the parameters; the conversion keeps them, so any order would do.
        convert_to_float8(model)
    optimizer = _built(task["optimizer"], "task.optimizer", object)(model.parameters())
    factor = lr_scale_factor(world_size, settings.lr_scale_ratio)
    for group in optimizer.param_groups:
        group["lr"] *= factor
    scheduler = _built(task["scheduler"], "task.scheduler", object)(optimizer) if task["scheduler"] else None
    eval_data = as_dataset(instantiate(task["eval_data"]), "task.eval_data") if task["eval_data"] else None
    train_data = as_dataset(instantiate(task["train_data"]), "task.train_data", streams=True)
    batches = is_batch_dataset(train_data)
    # A factory's dataset: its kind is known only now (a dataset class was checked before the ranks started).
    kind = type(train_data).__qualname__
    problems = batch_dataset_problems(settings.num_workers, task["collate_fn"], kind) if batches else []
    if problems:
        raise ValueError("; ".join(problems))
    cacheable = task["cacheable"] if task["cacheable"] is not None else batches
    if cacheable and settings.check_purity:
        check_purity(train_data, "task.train_data")
    seed_rank_streams(settings.seed, rank)
    return TaskParts(
        model=model,
        train_data=train_data,
        eval_data=eval_data,
        loss_fn=per_step_callable(_built(task["loss"], "task.loss", object)),
        eval_fn=_step_callable_of(task["eval_fn"], "task.eval_fn"),
        optimizer=optimizer,
        scheduler=scheduler,
        transform=_step_callable_of(task["transform"], "task.transform"),
        collate=_step_callable_of(task["collate_fn"], "task.collate_fn") or default_collate,
        cacheable=cacheable,
    )


def _step_callable_of(node: Any, key: str) -> Any:
    return per_step_callable(_built(node, key, object)) if node else None


class _AuthorizedOnce:
    """A config partial (`_partial_: true`) called every step. Hydra 1.3.8 wraps such partials in a
    subclass of functools.partial that re-runs its target policy on every call (a few percent of a small
    model's step, docs/your-task.md); here Hydra authorizes the first call and later calls go to the same
    function with the same bound arguments directly."""

    def __init__(self, deferred: functools.partial) -> None:
        self._deferred = deferred
        self._direct: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._direct is not None:
            return self._direct(*args, **kwargs)
        result = self._deferred(*args, **kwargs)
        d = self._deferred
        self._direct = functools.partial(d.func, *d.args, **d.keywords)
        return result


def per_step_callable(obj: Any) -> Any:
    """`obj`, or for a Hydra partial that re-authorizes each call, the same partial authorized once."""
    if isinstance(obj, functools.partial) and type(obj) is not functools.partial:
        return _AuthorizedOnce(obj)
    return obj


def _built(node: Any, key: str, kind: type) -> Any:
    try:
        obj = instantiate(node)
    except Exception as err:
        raise ValueError(f"{key}: could not instantiate {node!r}: {err}") from err
    if not isinstance(obj, kind):
        raise TypeError(f"{key}: expected {kind.__name__}, got {type(obj).__name__}")
    return obj
