"""Callbacks: your objects, called by flodl on rank 0 at the points of a run.

List them under `callbacks:` as Hydra `_target_` configs; each is built once on rank 0 and may define any
of these methods (a missing one is skipped):

- `on_run_start(run: Run)`: before the first epoch; keep `run` to stop the run or reach its files.
- `on_epoch_end(epoch: int, metrics: dict)`: after each epoch, with its `metrics.jsonl` record.
- `on_eval(epoch: int, metrics: dict[str, float])`: after each evaluated epoch, with its `eval/<name>` values.
- `on_checkpoint(epoch: int, path: Path)`: after a checkpoint is committed (after its epoch's hooks; with
  parts written in the background, possibly after a later epoch's).
- `on_run_end(summary: RunSummary)`: after the final `model.pt` is written.

They run in rank 0's coordinator thread, never on the training step's path; an exception stops the run,
naming the callback and the hook. `BestModel` and `EarlyStopping` below use only this module.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from flodl.coordinator.hooks import Run, RunSummary
from flodl.counting import shown_epoch

__all__ = ["BestModel", "EarlyStopping", "Run", "RunSummary"]

log = logging.getLogger("flodl")

MODES = ("min", "max")


class _Monitor:
    """A monitored metric and which way is better."""

    def __init__(self, owner: str, monitor: str, mode: str, min_delta: float = 0.0) -> None:
        if mode not in MODES:
            raise ValueError(f"{owner}: mode={mode!r} must be one of {', '.join(MODES)}")
        self.owner = owner
        self.monitor = monitor
        self.mode = mode
        self.min_delta = min_delta
        self.best: float | None = None
        self.best_epoch: int | None = None

    def value(self, metrics: dict[str, Any]) -> float:
        if self.monitor not in metrics:
            known = ", ".join(sorted(k for k, v in metrics.items() if isinstance(v, (int, float))))
            raise KeyError(f"{self.owner}: monitor={self.monitor!r} is not among {known}")
        return float(metrics[self.monitor])

    def improved(self, epoch: int, value: float) -> bool:
        """Record `value`; True if it beats the best so far by more than min_delta."""
        if not math.isfinite(value):
            return False
        better = (
            self.best is None
            or (self.mode == "min" and value < self.best - self.min_delta)
            or (self.mode == "max" and value > self.best + self.min_delta)
        )
        if better:
            self.best, self.best_epoch = value, epoch
        return better


class BestModel:
    """Keep `best.pt` (in the run dir): the model whose eval was best by `monitor` (e.g. `eval/accuracy`).

    It holds the parameters that were evaluated: rank 0 writes them when it evaluates (under sync its
    model after the epoch; under cadence and async the consensus of the round the eval ran on, before any
    EASGD blend), and `on_eval` moves that file to `best.pt` if the eval is the best so far. A plain state
    dict, like `model.pt`.
    """

    wants_evaluated_model = True

    def __init__(self, monitor: str = "eval/loss", mode: str = "min", filename: str = "best.pt") -> None:
        self.best = _Monitor("BestModel", monitor, mode)
        self.filename = filename
        self.run: Run | None = None

    def on_run_start(self, run: Run) -> None:
        self.run = run

    def on_eval(self, epoch: int, metrics: dict[str, float]) -> None:
        assert self.run is not None
        value = self.best.value(metrics)
        if self.best.improved(epoch, value):
            os.replace(self.run.evaluated_model(epoch), self.run.run_dir / self.filename)
            monitor, shown = self.best.monitor, shown_epoch(epoch)
            log.info("BestModel: %s=%.4f at epoch %d -> %s", monitor, value, shown, self.filename)


class EarlyStopping:
    """Stop the run once `monitor` has not improved by more than `min_delta` for `patience` reports.

    `monitor` is any key of an epoch's metrics.jsonl record (`loss`, `eval/accuracy`, ...); epochs that lack
    it (no eval that epoch) do not count. Every rank stops at the same epoch and `model.pt` holds the
    consensus there (see `Run.stop` for where the stop lands under each policy).
    """

    def __init__(
        self, monitor: str = "eval/loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0
    ) -> None:
        if patience < 1:
            raise ValueError(f"EarlyStopping: patience={patience} must be >= 1")
        self.best = _Monitor("EarlyStopping", monitor, mode, min_delta)
        self.patience = patience
        self.waited = 0
        self.run: Run | None = None

    def on_run_start(self, run: Run) -> None:
        self.run = run

    def on_epoch_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        assert self.run is not None
        is_eval = self.best.monitor.startswith("eval/")
        if is_eval and not any(k.startswith("eval/") for k in metrics):
            return  # not evaluated this epoch
        if self.best.improved(epoch, self.best.value(metrics)):
            self.waited = 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            best = self.best
            where = (
                "no finite value yet"
                if best.best_epoch is None
                else f"best {best.best:.4g} at epoch {shown_epoch(best.best_epoch)}"
            )
            self.run.stop(
                f"EarlyStopping: {best.monitor} did not improve for {self.patience} report(s) ({where})"
            )
