"""Pre-flight checks of the `_target_`s a config names, run before any rank starts, so a typo is one line,
not N tracebacks: each target imports, and the task's data keys fit the dataset's kind where the target's
class tells it. Nothing is built (a dataset may be large); a factory function's dataset is checked again
when the ranks build it (flodl/worker/task_setup.py).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flodl.config.schema import FlodlConfig

TASK_TARGETS = (
    "model",
    "train_data",
    "eval_data",
    "loss",
    "eval_fn",
    "optimizer",
    "scheduler",
    "transform",
    "collate_fn",
)


def locate(path: str) -> object:
    """The object at dotted `path`: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: object = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            # Only a missing prefix of the path itself means "try shorter"; a missing import inside a found
            # module is the user's error to see.
            if err.name is None or not (module_name + ".").startswith(err.name + "."):
                raise
            if cut == 1:
                raise
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"empty target {path!r}")


def _import_problem(where: str, target: str, err: BaseException) -> str:
    return (
        f"{where}._target_={target!r}: does not import ({type(err).__name__}: {err}); fix the dotted path, "
        "or make its module importable from the run's directory (PYTHONPATH)"
    )


def task_target_paths(cfg: FlodlConfig) -> list[str]:
    """The dotted paths of the task's `_target_`s, which a rank imports as it builds its task."""
    nodes = [getattr(cfg.task, key) for key in TASK_TARGETS]
    return [
        node["_target_"] for node in nodes if isinstance(node, dict) and isinstance(node.get("_target_"), str)
    ]


def task_target_problems(cfg: FlodlConfig) -> list[str]:
    problems = []
    for key in TASK_TARGETS:
        node = getattr(cfg.task, key)
        target = node.get("_target_") if isinstance(node, dict) else None
        if not isinstance(target, str):
            continue
        try:
            obj = locate(target)
        except Exception as err:  # whatever importing the user's module raises
            problems.append(_import_problem(f"task.{key}", target, err))
            continue
        if key == "collate_fn" and inspect.isfunction(obj) and not node.get("_partial_"):
            problems.append(
                f"task.collate_fn._target_={target!r}: is a function; add `_partial_: true` so flodl "
                "calls it with each list of samples"
            )
        if key == "train_data" and isinstance(obj, type) and hasattr(obj, "get_batch"):
            problems += batch_dataset_problems(cfg.num_workers, cfg.task.collate_fn, obj.__qualname__)
    return problems


def list_target_problems(key: str, nodes: list[Any]) -> Iterator[str]:
    """One problem per entry of the list `key` that is no `_target_` config or whose target won't import."""
    for i, node in enumerate(nodes):
        where = f"{key}[{i}]"
        if not isinstance(node, dict) or not isinstance(node.get("_target_"), str):
            yield f"{where}={node!r}: must be a mapping with a _target_ (e.g. {{_target_: mypkg.MyCallback}})"
            continue
        try:
            locate(node["_target_"])
        except Exception as err:  # whatever importing the user's module raises
            yield _import_problem(where, node["_target_"], err)


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
