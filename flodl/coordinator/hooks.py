"""The user's callbacks (flodl/callbacks.py), called from rank 0's coordinator thread, and what they get.

A hook a callback does not define is skipped; an exception from one becomes a CallbackError naming the
callback's class and the hook, which stops the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flodl.checkpoints.disk import evaluated_model_path


@dataclass
class Run:
    """What a callback knows about the run, and what it may ask of it."""

    run_dir: Path
    policy: str
    world_size: int
    epochs: int
    # The resolved config, as plain values.
    config: dict[str, Any]
    # Set by `stop`: the run ends at the next epoch boundary no rank has been handed work past.
    stop_reason: str | None = None
    # Whether rank 0 writes the parameters it evaluated (a callback with `wants_evaluated_model = True`).
    keeps_evaluated_models: bool = False

    def stop(self, reason: str) -> None:
        """End the run early: every rank stops at the same epoch boundary and the consensus there is saved
        as `model.pt`. Under sync and cadence the epoch after the one just reported may already be handed
        out; under async the epoch being handed out is finished first."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def evaluated_model(self, epoch: int) -> Path:
        """The file holding the parameters evaluated for `epoch` (the consensus of that eval), valid during
        `on_eval(epoch, ...)`; flodl deletes it afterwards unless a callback moved it away."""
        if not self.keeps_evaluated_models:
            raise RuntimeError("evaluated models are written only for a callback with wants_evaluated_model")
        return evaluated_model_path(self.run_dir, epoch)


@dataclass(frozen=True)
class RunSummary:
    # The last epoch trained (0-based) and why the run ended before `epochs`, if it did.
    last_epoch: int
    stopped: str | None
    model_path: Path
    # The last epoch's metrics.jsonl record.
    last_metrics: dict[str, Any] = field(default_factory=dict)


class CallbackError(RuntimeError):
    pass


def _name(callback: object) -> str:
    kind = type(callback)
    return f"{kind.__module__}.{kind.__qualname__}"


class Hooks:
    def __init__(self, callbacks: list[object], run: Run) -> None:
        self.callbacks = callbacks
        self.run = run
        run.keeps_evaluated_models = any(getattr(c, "wants_evaluated_model", False) for c in callbacks)

    def call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is None:
                continue
            try:
                method(*args)
            except Exception as err:
                raise CallbackError(
                    f"callback {_name(callback)}.{hook} raised {type(err).__name__}: {err}"
                ) from err

    def run_start(self) -> None:
        self.call("on_run_start", self.run)

    def epoch_end(self, epoch: int, record: dict[str, Any]) -> None:
        """`on_epoch_end`, then `on_eval` for an evaluated epoch (its evaluated model removed after)."""
        self.call("on_epoch_end", epoch, record)
        evals = {k: v for k, v in record.items() if k.startswith("eval/")}
        if not evals:
            return
        try:
            self.call("on_eval", epoch, evals)
        finally:
            if self.run.keeps_evaluated_models:
                evaluated_model_path(self.run.run_dir, epoch).unlink(missing_ok=True)

    def checkpoint(self, epoch: int, path: Path) -> None:
        self.call("on_checkpoint", epoch, path)

    def run_end(self, summary: RunSummary) -> None:
        self.call("on_run_end", summary)
        evaluated = evaluated_model_path(self.run.run_dir, 0).parent
        if evaluated.is_dir() and not any(evaluated.iterdir()):
            evaluated.rmdir()
