"""Pre-flight checks of the task's `_target_`s, run before any rank starts: each target imports, and the
data keys fit the dataset's kind where the target's class tells it. Nothing is built (a dataset may be
large); a factory function's dataset is checked again when the ranks build it (flodl/worker/task_setup.py).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from hydra._internal.utils import _locate

if TYPE_CHECKING:
    from flodl.config.schema import FlodlConfig

TASK_TARGETS = (
    "model", "train_data", "eval_data", "loss", "eval_fn", "optimizer", "scheduler", "transform",
    "collate_fn",
)  # fmt: skip


def target_problems(cfg: FlodlConfig) -> list[str]:
    problems = []
    for key in TASK_TARGETS:
        node = getattr(cfg.task, key)
        target = node.get("_target_") if isinstance(node, dict) else None
        if not isinstance(target, str):
            continue
        try:
            obj = _locate(target)
        except Exception as err:
            cause = err.__cause__ or err
            problems.append(
                f"task.{key}._target_={target!r}: does not import ({type(cause).__name__}: {cause}); fix the "
                "dotted path, or make its module importable from the run's directory (PYTHONPATH)"
            )
            continue
        if key == "collate_fn" and inspect.isfunction(obj) and not node.get("_partial_"):
            problems.append(
                f"task.collate_fn._target_={target!r}: is a function; add `_partial_: true` so flodl "
                "calls it with each list of samples"
            )
        if key == "train_data" and isinstance(obj, type) and hasattr(obj, "get_batch"):
            problems += batch_dataset_problems(cfg.num_workers, cfg.task.collate_fn, obj.__qualname__)
    return problems


def batch_dataset_problems(num_workers: int, collate_fn: Any, kind: str) -> list[str]:
    """Keys that apply to map-style Datasets only, set for a BatchDataSet (`kind`), which builds whole batches
    in its get_batch (also asked by the ranks, of a factory's dataset)."""
    why = f"task.train_data is a BatchDataSet ({kind}), whose get_batch builds whole batches in the rank"
    problems = []
    if num_workers > 0:
        problems.append(
            f"num_workers={num_workers}: {why}; worker processes read map-style Datasets: use num_workers=0"
        )
    if collate_fn is not None:
        problems.append(f"task.collate_fn={collate_fn!r}: {why}; remove collate_fn")
    return problems
