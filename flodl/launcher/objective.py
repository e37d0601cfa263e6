"""What a sweep's job returns to its sweeper: the run's objective, read from what the run recorded.

Hydra's sweepers that search (Optuna, Ax, Nevergrad) take the task function's return value as the trial's
value. flodl's is the last value of the config's `objective` in the run's metrics.jsonl (rank 0's host writes
it, every epoch record before the ranks are told the run ended, so any rank may read it once its own body
returned).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from flodl.metrics.sinks import METRICS_FILE, read_history


class NoObjective(RuntimeError):
    """The run recorded no finite value of its objective."""


def objective_key(objective: str | None, evaluates: bool) -> str:
    """The record key the objective names; null: the eval loss, or the training loss without eval."""
    if objective is not None:
        return objective
    return "eval/loss" if evaluates else "loss"


def objective_of(records: list[dict[str, Any]], key: str) -> float:
    """The last recorded value of `key`; NoObjective when no record holds it, or the last is not finite."""
    held = [record for record in records if record.get(key) is not None or key in record.get("nonfinite", [])]
    if not held:
        keys = sorted({k for r in records for k, v in r.items() if k == "loss" or k.startswith("eval/")})
        recorded = f"recorded: {', '.join(keys)}" if keys else "no epoch was recorded"
        raise NoObjective(f"objective={key}: no epoch record holds it ({recorded})")
    last = held[-1]
    value = last.get(key)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise NoObjective(f"objective={key}: not finite at epoch {last['epoch']} ({value!r})")
    return float(value)


def read_objective(run_dir: Path, objective: str | None, evaluates: bool) -> float:
    path = run_dir / METRICS_FILE
    records = read_history(path) if path.is_file() else []
    return objective_of(records, objective_key(objective, evaluates))
