"""Where metrics go on rank 0: the console (a progress bar and one line per epoch) and `metrics.jsonl`.

Sinks get the live stream (`progress`, every `logger.log_every` steps of each rank) and the per-epoch
records (`emit`). The W&B sink lives in `wandb_sink.py`.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

from flodl.counting import shown_epoch
from flodl.links.messages import Progress
from flodl.metrics.aggregate import EpochMetrics

log = logging.getLogger("flodl")
METRICS_FILE = "metrics.jsonl"
BAR_WIDTH = 24
# Without a terminal the bar becomes a plain line at most this often.
PLAIN_EVERY_S = 10.0


class Sink(Protocol):
    def progress(self, report: Progress) -> None: ...

    def emit(self, metrics: EpochMetrics) -> None: ...

    def close(self) -> None: ...


MFU_UNKNOWN = (
    "MFU is not known here: no peak FLOPS for this device (the CPU, or a GPU not in flodl/metrics/flops.py's "
    "table); peak_tflops=<dense bf16 TFLOPS of one device> sets it"
)


def throughput_words(metrics: EpochMetrics) -> str:
    """The epoch line's throughput beyond samples/s: tokens/s, MFU, the data wait, the peak device memory
    (each when known)."""
    words = ""
    if metrics.tokens_per_s is not None:
        words += f"  {metrics.tokens_per_s / 1e3:.1f}k tok/s"
    if metrics.mfu is not None:
        words += f"  MFU {metrics.mfu:.1%}"
    words += f"  data {metrics.data_wait:.0%}"
    if metrics.peak_memory:
        words += f"  mem {metrics.peak_memory / 2**30:.1f} GiB"
    return words


def format_duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class ConsoleSink:
    """Rank 0's view: a live bar (epoch, step, loss, samples/s, ETA) and a line per finished epoch."""

    def __init__(self, epochs: int, total_batches: int, world_size: int, out: TextIO = sys.stdout) -> None:
        self.epochs = epochs
        # Batches over all ranks in the whole run: the bar's 100%.
        self.total_batches = total_batches
        self.out = out
        self.tty = out.isatty()
        self.started = time.perf_counter()
        self.steps = [0] * world_size
        # The busiest rank's steps so far, as the epoch lines count them (a rank cut since included).
        self.step = 0
        self.speed = [0.0] * world_size
        self._last_plain = 0.0
        self._bar_shown = False
        self._said_mfu_unknown = False

    def progress(self, report: Progress) -> None:
        self.steps[report.rank] = report.step
        self.step = max(self.step, report.step)
        self.speed[report.rank] = report.samples_per_s
        if report.rank != 0:
            return
        line = self.render(report)
        now = time.perf_counter()
        if self.tty:
            self.out.write("\r" + line)
            self._bar_shown = True
        elif now - self._last_plain >= PLAIN_EVERY_S:
            self.out.write(line + "\n")
            self._last_plain = now
        self.out.flush()

    def render(self, report: Progress) -> str:
        done = min(sum(self.steps) / self.total_batches, 1.0) if self.total_batches else 0.0
        elapsed = time.perf_counter() - self.started
        eta = elapsed * (1 - done) / done if done > 0 else 0.0
        filled = int(done * BAR_WIDTH)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        return (
            f"[r0] epoch {shown_epoch(report.epoch)}/{self.epochs} [{bar}] {done:4.0%} step {self.step} "
            f"loss {report.loss:.4f} {sum(self.speed):.0f} samples/s ETA {format_duration(eta)}"
        )

    def emit(self, metrics: EpochMetrics) -> None:
        self.step = max(self.step, metrics.step)
        if self._bar_shown:
            self.out.write("\r\033[K")  # the epoch line replaces the bar
            self.out.flush()
        evals = "".join(f"  eval/{k} {v:.4f}" for k, v in metrics.eval.items())
        if metrics.eval and metrics.eval_at_step not in (None, metrics.step):  # async: after the epoch's end
            evals += f" (at step {metrics.eval_at_step})"
        compiled = f" (compile {metrics.compile_s:.1f}s apart)" if metrics.compile_s else ""
        log.info(
            "epoch %d/%d  step %d  loss %.4f%s  %.0f samples/s%s  %.2fs%s  wire %.1f MB",
            shown_epoch(metrics.epoch),
            self.epochs,
            metrics.step,
            metrics.loss,
            evals,
            metrics.samples_per_s,
            throughput_words(metrics),
            metrics.epoch_s,
            compiled,
            metrics.comm_bytes / 1e6,
        )
        if metrics.mfu is None and not self._said_mfu_unknown:
            self._said_mfu_unknown = True
            log.info(MFU_UNKNOWN)

    def close(self) -> None:
        pass


def _finite(value: Any, path: str, bad: list[str]) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        bad.append(path)
        return None
    if isinstance(value, dict):
        return {k: _finite(v, f"{path}.{k}" if path else str(k), bad) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v, f"{path}.{i}", bad) for i, v in enumerate(value)]
    return value


def record_line(record: dict[str, Any]) -> str:
    """One line of strict JSON: a non-finite value (a skipped NaN window) becomes null, and the record
    lists where under `nonfinite` (dotted paths: `loss`, `per_rank.1.data_ms`)."""
    bad: list[str] = []
    finite = _finite(record, "", bad)
    if bad:
        finite["nonfinite"] = bad
    return json.dumps(finite, allow_nan=False) + "\n"


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def read_history(metrics_path: Path) -> list[dict[str, Any]]:
    """The records of `metrics.jsonl`; a torn or invalid line (a crash mid-write) is dropped, warned."""
    records = []
    for number, line in enumerate(metrics_path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line, parse_constant=_reject_constant)
            if not isinstance(record, dict) or not isinstance(record.get("epoch"), int):
                raise ValueError("not an epoch record")
        except ValueError as err:
            log.warning("%s line %d dropped (%s): %.80s", metrics_path, number, err, line)
            continue
        records.append(record)
    return records


class JsonlSink:
    """One JSON object per epoch, flushed as it happens so a crashed run keeps its history."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def progress(self, report: Progress) -> None:
        pass

    def emit(self, metrics: EpochMetrics) -> None:
        self.file.write(record_line(metrics.as_record()))
        self.file.flush()

    def close(self) -> None:
        self.file.close()
