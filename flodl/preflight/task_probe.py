"""The task's parts built once before any rank starts, as a rank builds them, to find what would fail there.

- The datasets are built (not their batches): a missing path, a split that does not exist, an empty
  dataset, a batch larger than the training data, and a stream (an IterableDataset) without
  steps_per_epoch, with what needs a sample index (views, a transform, the tiers), or whose split among
  its readers task.stream_split contradicts (flodl/data/stream_split.py) fail here, and so does a webdataset
  shard pattern that names files this host does not have.
- The model is built on the meta device (no memory, no weights), its optimizer and scheduler on its
  parameters: a model with nothing to train and a scheduler missing an argument fail here.
- `eval_fn` is called once on the first eval batch, on the meta device: what it returns must be the
  dict of sums the eval adds up, and hold the metric `objective` names (eval/<name>; without an eval_fn the
  eval records eval/loss). An eval_fn the meta device cannot run (one that reads a value with `.item()`) is
  left to the ranks, and so is its objective (a sweep's job then fails naming the metrics it recorded).

A sweep checks every job: the outcome is kept per task config, so each is built once per process.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn
from torch.utils.data import default_collate

from flodl.config.policy import step_samples, step_words
from flodl.config.schema import FlodlConfig
from flodl.data.dataset import as_dataset, is_stream, read_batch
from flodl.data.partition import equal_slices
from flodl.data.sample import to_device
from flodl.data.stream_split import decide
from flodl.logs import one_line

# Hydra's own keys in a `_target_` node: not arguments of the target.
HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")
_META = torch.device("meta")
# Per task config and the settings it is checked with: the problems found.
_PROBED: dict[str, list[str]] = {}


def task_problems(
    cfg: FlodlConfig, task: Mapping[str, Any], world_size: int, whole: bool = True
) -> list[str]:
    """What building the task's parts (`task`: its target nodes as plain data) finds wrong for a job of
    `world_size` ranks; each problem names its key. Not `whole`: the model alone (the config's values
    are refused already, and the rest would be built on them)."""
    settings = [
        cfg.batch_size,
        step_samples(cfg),
        cfg.augment,
        cfg.steps_per_epoch,
        cfg.persistent_workers,
        cfg.task.stream_split,
        cfg.num_workers,
        cfg.eval_every,
        cfg.objective,
    ]
    key = json.dumps([task, world_size, *settings, whole], default=str)
    if key not in _PROBED:
        # On one intra-op thread: the launcher may fork the ranks after this (launch.start_method=fork), and
        # an OpenMP thread team made here does not exist in them: their first parallel region waits for it
        # forever.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _PROBED[key] = _probe(cfg, task, world_size) if whole else _model_problems(task)[1]
        finally:
            torch.set_num_threads(threads)
    return list(_PROBED[key])


def _probe(cfg: FlodlConfig, task: Mapping[str, Any], world_size: int) -> list[str]:
    model, problems = _model_problems(task)
    data = {}
    for name in ("train_data", "eval_data"):
        if task.get(name) is not None:
            try:
                built = instantiate(task[name])
                data[name] = as_dataset(built, f"task.{name}", streams=name == "train_data")
            except Exception as err:
                problems.append(_failed(f"task.{name}", "building it", err))
    if "train_data" in data:
        problems += _train_data_problems(cfg, task, data["train_data"], world_size)
    if model is not None:
        problems += _optimizer_problems(cfg, task, model, data.get("eval_data"))
    return problems


def _failed(key: str, what: str, err: BaseException) -> str:
    """`key: what failed (Error: message)`; Hydra's wrapper of a target's error gives way to the error."""
    cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ is not None else err
    message = str(cause)
    if message.startswith(f"{key}: "):  # flodl's own words already name the key
        return one_line(message)
    return f"{key}: {what} failed ({type(cause).__name__}: {one_line(message)})"


def _train_data_problems(
    cfg: FlodlConfig, task: Mapping[str, Any], train_data: Any, world_size: int
) -> list[str]:
    kind = type(train_data).__name__
    if is_stream(train_data):
        return (
            _stream_problems(cfg, task, kind)
            + _split_problems(cfg, train_data, world_size)
            + _shard_problems(task["train_data"], train_data)
        )
    if cfg.task.stream_split != "auto":
        return [
            f"task.stream_split={cfg.task.stream_split}: applies to a stream (an IterableDataset as "
            f"task.train_data); {kind} is split by sample index, leave it auto"
        ]
    if cfg.steps_per_epoch is not None:
        return [
            f"steps_per_epoch={cfg.steps_per_epoch}: applies to a stream (an IterableDataset as "
            f"task.train_data); {kind} has a length, and each epoch reads all of it"
        ]
    return _epoch_fit_problems(cfg, len(train_data) * cfg.augment, world_size)


def _stream_problems(cfg: FlodlConfig, task: Mapping[str, Any], kind: str) -> list[str]:
    """What a stream needs, and what it cannot do: it has no length and no sample index."""
    problems = []
    if cfg.steps_per_epoch is None:
        problems.append(
            f"task.train_data: {kind} is an IterableDataset (a stream), which has no length to make an epoch "
            "of: set steps_per_epoch, the optimizer steps per rank per epoch (README: Streams)"
        )
    if cfg.augment != 1:
        problems.append(
            f"augment={cfg.augment}: a stream's items have no index to key views by; augment inside the "
            "stream, with augment=1"
        )
    if task.get("transform"):
        problems.append(
            "task.transform: its keys name sample indices, which a stream has none of; transform inside the "
            "stream or in task.collate_fn"
        )
    if task.get("cacheable"):
        problems.append(
            "task.cacheable=true: the tiers keep samples by index, and a stream is read in order; leave it "
            "null"
        )
    if not cfg.persistent_workers:
        problems.append(
            "persistent_workers=false: a stream's DataLoader workers read for the whole run, never "
            "restarted; leave it true"
        )
    return problems


def _split_problems(cfg: FlodlConfig, train_data: Any, world_size: int) -> list[str]:
    """A stream's split among its readers as every rank will decide it: a contradiction is refused here."""
    try:
        decide(train_data, cfg.task.stream_split, world_size, cfg.num_workers)
    except ValueError as err:
        return [one_line(str(err))]
    return []


def _shard_problems(node: Mapping[str, Any], train_data: Any) -> list[str]:
    """A webdataset pipeline's shards (its first stage's URLs) that are files on this host and do not exist:
    every rank would fail at its first read of one. Named by the key of `node` whose pattern names them."""
    stages = getattr(train_data, "pipeline", None)
    urls = getattr(stages[0], "urls", None) if stages else None
    if not isinstance(urls, list) or not urls:
        return []
    missing = [url for url in urls if (path := _local_file(url)) is not None and not path.exists()]
    if not missing:
        return []
    key, pattern = _naming(node, "task.train_data", missing[0]) or ("task.train_data", urls[0])
    first = missing[0] if Path(missing[0]).is_absolute() else f"{missing[0]} in {Path.cwd()}"
    return [
        f"{key}={pattern!r}: names no file for {len(missing)} of its {len(urls)} shards (the first: "
        f"{first}); fix the pattern or write the shards first"
    ]


def _local_file(url: str) -> Path | None:
    """The file a shard URL reads (a plain path or file:), None for a URL read otherwise (pipe:, http:)."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return Path(parsed.path)
    return Path(url) if parsed.scheme == "" else None


def _naming(node: Any, key: str, url: str) -> tuple[str, Any] | None:
    """The key under `node` (and its value) whose shard pattern or list names `url`."""
    from webdataset.shardlists import expand_urls

    if isinstance(node, Mapping):
        found = (_naming(value, f"{key}.{name}", url) for name, value in node.items())
        return next((hit for hit in found if hit is not None), None)
    if isinstance(node, (str, list)) and url in expand_urls(node):
        return key, node
    return None


def _epoch_fit_problems(cfg: FlodlConfig, total_picks: int, world_size: int) -> list[str]:
    if equal_slices(total_picks, world_size, step_samples(cfg))[0].size > 0:
        return []
    return [
        f"batch_size={cfg.batch_size}: {world_size} rank(s) x {step_words(cfg)} exceeds the {total_picks} "
        "training picks (task.train_data x augment), so an epoch has no optimizer step"
    ]


def _model_problems(task: Mapping[str, Any]) -> tuple[nn.Module | None, list[str]]:
    """The model built on the meta device, or why it cannot train."""
    try:
        with _META, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about zero-element tensors: reported below
            model = instantiate(task["model"])
    except Exception as err:
        return None, [_failed("task.model", "building it", err)]
    if not isinstance(model, nn.Module):
        return None, [f"task.model: expected an nn.Module, got {type(model).__name__}"]
    capacity = _capacity_problem(model, task["model"])
    return (None, [capacity]) if capacity is not None else (model, [])


def _optimizer_problems(
    cfg: FlodlConfig, task: Mapping[str, Any], model: nn.Module, eval_data: Any
) -> list[str]:
    try:
        optimizer = instantiate(task["optimizer"])(model.parameters())
    except Exception as err:
        return [_failed("task.optimizer", "building it on the model's parameters", err)]
    problems = []
    if task.get("scheduler"):
        try:
            instantiate(task["scheduler"])(optimizer)
        except Exception as err:
            problems.append(_failed("task.scheduler", "building it on the optimizer", err))
    if eval_data is not None and cfg.eval_every > 0:
        problems += _eval_problems(cfg, task, model, eval_data)
    return problems


def _capacity_problem(model: nn.Module, node: Mapping[str, Any]) -> str | None:
    """A model whose trainable tensors hold no element."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    empty = [f"{name} {tuple(p.shape)}" for name, p in params if p.numel() == 0]
    if params and not empty:
        return None
    what = f"parameters with a zero-size dimension: {', '.join(empty)}" if empty else "no trainable parameter"
    return f"task.model: has {what}; check its width arguments ({given(node)})"


def _eval_problems(cfg: FlodlConfig, task: Mapping[str, Any], model: nn.Module, eval_data: Any) -> list[str]:
    """eval_fn on the first eval batch, as the rank's eval calls it; what it returns must be a dict of
    tensors (per-batch sums, which the eval adds up and divides by the eval samples), holding the metric
    `objective` names. Without an eval_fn the eval measures the task's loss."""
    if not task.get("eval_fn"):
        return _objective_problems(cfg.objective, ["loss"])
    try:
        collate = instantiate(task["collate_fn"]) if task.get("collate_fn") else default_collate
        indices = torch.arange(min(cfg.batch_size, len(eval_data)))
        batch = read_batch(eval_data, indices, collate)
        eval_fn = instantiate(task["eval_fn"])
    except Exception as err:
        return [_failed("task.eval_data", "reading its first batch", err)]
    model.eval()
    try:
        with torch.no_grad():
            measured = eval_fn(model, to_device(batch, _META))
    except Exception:  # the meta device cannot run every eval_fn: its ranks will tell
        return []
    tensors = isinstance(measured, Mapping) and all(isinstance(v, torch.Tensor) for v in measured.values())
    if tensors and measured:
        return _objective_problems(cfg.objective, list(measured))
    got = (
        ", ".join(f"{k}: {type(v).__name__}" for k, v in measured.items()) or "an empty dict"
        if isinstance(measured, Mapping)
        else type(measured).__name__
    )
    return [
        f"task.eval_fn: returned {got} for a batch; it must return a dict of tensors, the batch's sums "
        "by metric name (the eval adds them up over the eval set and divides by its samples)"
    ]


def _objective_problems(objective: str | None, metrics: list[str]) -> list[str]:
    """An `objective` of eval/<name> names a metric the eval records (loss and null are the rules')."""
    if objective is None or not objective.startswith("eval/") or objective[len("eval/") :] in metrics:
        return []
    records = ", ".join(f"eval/{name}" for name in sorted(metrics))
    return [f"objective={objective!r}: the run's eval records no such metric ({records}); name one of them"]


def given(node: Mapping[str, Any]) -> str:
    """A target node's arguments, as a problem quotes them."""
    kwargs = {k: v for k, v in node.items() if k not in HYDRA_KEYS}
    return "given " + (", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "no arguments")
