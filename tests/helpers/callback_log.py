"""Callbacks for the end-to-end tests, importable by the ranks (module-level classes, public API only)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from flodl.callbacks import Run, RunSummary

HOOKS_FILE = "hooks.jsonl"


class Recorder:
    """Writes every hook call, in order, to `hooks.jsonl` in the run dir."""

    def __init__(self) -> None:
        self.path: Path | None = None

    def _write(self, **entry: Any) -> None:
        assert self.path is not None
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")

    def on_run_start(self, run: Run) -> None:
        self.path = run.run_dir / HOOKS_FILE
        self._write(hook="on_run_start", policy=run.policy, world_size=run.world_size, epochs=run.epochs)

    def on_epoch_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        self._write(hook="on_epoch_end", epoch=epoch, metrics=metrics)

    def on_eval(self, epoch: int, metrics: dict[str, float]) -> None:
        self._write(hook="on_eval", epoch=epoch, metrics=metrics)

    def on_checkpoint(self, epoch: int, path: Path) -> None:
        self._write(
            hook="on_checkpoint", epoch=epoch, path=str(path), committed=(path / "manifest.json").is_file()
        )

    def on_run_end(self, summary: RunSummary) -> None:
        self._write(
            hook="on_run_end",
            last_epoch=summary.last_epoch,
            stopped=summary.stopped,
            model_saved=summary.model_path.is_file(),
            last_metrics=summary.last_metrics,
        )


class Failing:
    """Raises in `on_eval` of `epoch`."""

    def __init__(self, epoch: int = 1) -> None:
        self.epoch = epoch

    def on_eval(self, epoch: int, metrics: dict[str, float]) -> None:
        if epoch == self.epoch:
            raise ValueError(f"refusing epoch {epoch}")


class StopOnceAdmitted:
    """Ends the run at the epoch after the one whose record shows a rank admitted back: a restart test waits
    for the admission itself, however long a restarted process takes to start on a loaded machine."""

    def __init__(self) -> None:
        self.run: Run | None = None

    def on_run_start(self, run: Run) -> None:
        self.run = run

    def on_epoch_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        assert self.run is not None
        if any(change["event"] == "rank_admitted" for change in metrics["membership"]):
            self.run.stop(f"a rank was admitted back in epoch {epoch}")


class HoldAfterFirstEpoch:
    """Writes `first-epoch-recorded` in the run dir once the first epoch's record is written, then holds the
    coordinator there for good (nothing is committed after it): a test kills the run at that point, before
    any checkpoint, however fast the ranks train on meanwhile."""

    def on_run_start(self, run: Run) -> None:
        self.run_dir = run.run_dir

    def on_epoch_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        (self.run_dir / "first-epoch-recorded").touch()
        threading.Event().wait()


class StopOnceGrown:
    """Ends the run at the end of the first epoch trained whole by `world` ranks once `admissions` ranks were
    admitted: a growth test waits for the joiners' admission itself, however long they take to start on a
    loaded machine."""

    def __init__(self, world: int, admissions: int = 1) -> None:
        self.world = world
        self.admissions = admissions
        self.run: Run | None = None
        self._admitted = 0
        self._grown = False

    def on_run_start(self, run: Run) -> None:
        self.run = run

    def on_epoch_end(self, epoch: int, metrics: dict[str, Any]) -> None:
        assert self.run is not None
        if self._grown and metrics["world"] >= self.world:
            self.run.stop(f"{self.world} ranks trained epoch {epoch} whole")
        self._admitted += sum(change["event"] == "rank_admitted" for change in metrics["membership"])
        self._grown = self._admitted >= self.admissions and metrics["world"] >= self.world
