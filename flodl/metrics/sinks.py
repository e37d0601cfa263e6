"""Where EpochMetrics go: rank 0's console and `metrics.jsonl` in the run dir."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Protocol

from flodl.metrics.aggregate import EpochMetrics

log = logging.getLogger("flodl")


class Sink(Protocol):
    def emit(self, metrics: EpochMetrics) -> None: ...

    def close(self) -> None: ...


class ConsoleSink:
    def __init__(self, epochs: int) -> None:
        self.epochs = epochs

    def emit(self, metrics: EpochMetrics) -> None:
        evals = "".join(f"  eval/{k} {v:.4f}" for k, v in metrics.eval.items())
        log.info(
            "epoch %d/%d  step %d  loss %.4f%s  %.0f samples/s  %.2fs  wire %.1f MB",
            metrics.epoch + 1, self.epochs, metrics.step, metrics.loss, evals,
            metrics.samples_per_s, metrics.epoch_s, metrics.comm_bytes / 1e6,
        )  # fmt: skip

    def close(self) -> None:
        pass


class JsonlSink:
    """One JSON object per epoch, flushed as it happens so a crashed run keeps its history."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def emit(self, metrics: EpochMetrics) -> None:
        self.file.write(json.dumps(metrics.as_record()) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
