"""The W&B sink: one run per job, from rank 0, fed as training goes (not at the end).

- group = the sweep (or the run), job_type = the policy, name = Hydra's override dirname, a deterministic id
  from the run dir with `resume="allow"`; config = the resolved config, overrides, git commit, command.
- Axes: `train/*`, `eval/*` and `rank{r}/*` against `train/step`; `epoch/*` against `epoch`; `comm/*` against
  `comm/bytes_total`.
- W&B must never cost a run: a failure (no network, no key, an error inside `log`) is reported once and the
  sink goes quiet; `finish()` always runs and is bounded in time.
wandb is imported only when this sink is used.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flodl.metrics.aggregate import EpochMetrics
from flodl.metrics.run_info import RunInfo
from flodl.wire.messages import Progress

log = logging.getLogger("flodl")
FINISH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WandbSettings:
    """The `logger` keys W&B reads (mapped once, by flodl/assembly.py)."""

    # online, offline (written under the run dir, `wandb sync` later) or disabled.
    mode: str
    project: str
    entity: str | None
    tags: tuple[str, ...]


class WandbSink:
    def __init__(self, settings: WandbSettings, info: RunInfo, config: dict[str, Any], policy: str) -> None:
        self.run: Any = None
        self._failed = False
        self._guard(lambda: self._start(settings, info, config, policy), "could not start the W&B run")

    def _start(self, settings: WandbSettings, info: RunInfo, config: dict[str, Any], policy: str) -> None:
        import wandb

        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            tags=list(settings.tags),
            group=info.group,
            job_type=policy,
            name=info.name,
            id=info.run_id,
            resume="allow",
            dir=str(Path(info.run_dir)),
            mode=settings.mode,
            config={**config, "flodl": info.as_dict()},
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        self.run.define_metric("train/step")
        self.run.define_metric("epoch")
        self.run.define_metric("comm/bytes_total")
        for pattern in ("train/*", "eval/*", "rank*"):
            self.run.define_metric(pattern, step_metric="train/step")
        self.run.define_metric("epoch/*", step_metric="epoch")
        self.run.define_metric("comm/*", step_metric="comm/bytes_total")

    def progress(self, report: Progress) -> None:
        if report.rank == 0:
            row = {
                "train/step": report.step,
                "train/loss": report.loss,
                "train/samples_per_s": report.samples_per_s,
                "train/lr": report.lr,
            }
        else:
            row = {"train/step": report.step, f"rank{report.rank}/loss": report.loss}
            row[f"rank{report.rank}/samples_per_s"] = report.samples_per_s
        self._log(row)

    def emit(self, metrics: EpochMetrics) -> None:
        row: dict[str, float] = {
            "epoch": metrics.epoch,
            "train/step": metrics.step,
            "epoch/loss": metrics.loss,
            "epoch/samples_per_s": metrics.samples_per_s,
            "epoch/epoch_s": metrics.epoch_s,
            "epoch/lr": metrics.lr,
            "epoch/rounds": metrics.rounds,
            "comm/bytes_total": metrics.comm_bytes_total,
            "comm/bytes": metrics.comm_bytes,
            "comm/loss": metrics.loss,
        }
        row.update({f"eval/{name}": value for name, value in metrics.eval.items()})
        row.update({f"comm/eval_{name}": value for name, value in metrics.eval.items()})
        if metrics.eval_step is not None:
            row["epoch/eval_step"], row["epoch/eval_samples"] = metrics.eval_step, metrics.eval_samples
        row.update({f"epoch/{name}": value for name, value in metrics.scalars.items()})
        for share in metrics.per_rank:
            row[f"rank{share.rank}/batch_share"] = share.batch_share
            row[f"rank{share.rank}/epoch_samples_per_s"] = share.samples_per_s
            row[f"rank{share.rank}/data_ms"] = share.data_ms
            row[f"rank{share.rank}/averaging_blocked_ms"] = share.averaging_blocked_ms
        self._log(row)

    def close(self) -> None:
        """Finish the run, but never wait more than FINISH_TIMEOUT_S for it."""
        if self.run is None:
            return
        run, self.run = self.run, None
        finisher = threading.Thread(target=lambda: self._guard(run.finish, "W&B finish failed"), daemon=True)
        finisher.start()
        finisher.join(FINISH_TIMEOUT_S)
        if finisher.is_alive():
            log.warning("W&B finish did not return within %.0f s; leaving it behind", FINISH_TIMEOUT_S)

    def _log(self, row: dict[str, float]) -> None:
        if self.run is not None:
            self._guard(lambda: self.run.log(row), "W&B logging failed")

    def _guard(self, action: Callable[[], object], what: str) -> None:
        """Run `action`; on the first failure report it once and stop using W&B for this run."""
        try:
            action()
        except Exception as err:
            if not self._failed:
                log.warning("%s (%s: %s); training goes on without W&B", what, type(err).__name__, err)
            self._failed = True
            self.run = None
