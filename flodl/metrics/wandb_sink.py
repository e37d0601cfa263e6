"""The W&B sink: one run per job, from rank 0, fed as training goes (not at the end).

- Every `logger.*` key left null defers to W&B's environment (WANDB_MODE, WANDB_PROJECT, ...) or default;
  where neither the config nor the environment says, group = the sweep (or the run), job_type = the policy,
  name = the overrides the sweep varies, dir = the run dir. A deterministic id from the run dir;
  config = the resolved config (nested), overrides, the user's git commit, command.
- One W&B run across the job's starts: a start resumed from a checkpoint passes `resume="allow"` (a fresh
  start none), and every row is logged at an explicit `_step` going on from the last start's, each epoch
  and each rank's progress step once (flodl/metrics/wandb_cursor.py); a resume on another number of ranks
  says so in the summary (`resize`).
- Axes: `train/*`, `eval/*` and `rank{r}/*` against `train/step`; `epoch/*` against `epoch`; `comm/*` against
  `comm/bytes_total`. An eval is a row of its own at the `train/step` where its model was taken (async:
  after its epoch's end), once even when it stands for several epochs.
- W&B failing to start stops the run before it trains (WandbStartError), unless `logger.required=false`.
  Once running, W&B must never cost a run: a failure inside `log` is reported once and the sink goes
  quiet; `finish()` always runs and is bounded in time.
wandb is imported only when this sink is used.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flodl.links.messages import Progress
from flodl.metrics.aggregate import EpochMetrics
from flodl.metrics.run_info import RunInfo
from flodl.metrics.wandb_cursor import CURSOR_FILE, Cursor

log = logging.getLogger("flodl")
FINISH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WandbSettings:
    """The `logger` keys W&B reads (mapped once, by the assembly); None defers to W&B's environment."""

    # online, offline (written under the run dir or WANDB_DIR, `wandb sync` later) or disabled.
    mode: str | None = None
    project: str | None = None
    entity: str | None = None
    tags: tuple[str, ...] | None = None
    group: str | None = None
    run_name: str | None = None
    job_type: str | None = None
    notes: str | None = None
    # W&B failing to start stops the run; False: warn once and train without it.
    required: bool = True


@dataclass(frozen=True)
class Resumed:
    """This start of the job continues from a checkpoint: the first epoch it trains, and the ranks of the
    world that wrote the checkpoint and of this one (a resize where they differ)."""

    epoch: int
    saved_world: int
    world: int


class WandbStartError(RuntimeError):
    """W&B could not start and `logger.required` is true."""


def init_arguments(settings: WandbSettings, info: RunInfo, policy: str) -> dict[str, Any]:
    """wandb.init's arguments: what the config sets, else flodl's choice unless W&B's environment has one."""
    chosen = {
        "project": settings.project,
        "entity": settings.entity,
        "tags": None if settings.tags is None else list(settings.tags),
        "notes": settings.notes,
        "mode": settings.mode,
        "group": settings.group,
        "name": settings.run_name,
        "job_type": settings.job_type,
        "dir": None,
    }
    flodl_default = {
        "group": ("WANDB_RUN_GROUP", info.group),
        "name": ("WANDB_NAME", info.name),
        "job_type": ("WANDB_JOB_TYPE", policy),
        "dir": ("WANDB_DIR", info.run_dir),
    }
    for key, (variable, value) in flodl_default.items():
        if chosen[key] is None and variable not in os.environ:
            chosen[key] = value
    return {key: value for key, value in chosen.items() if value is not None}


def start_problem(settings: WandbSettings) -> str | None:
    """Why W&B would refuse to start at once, asked before any rank starts: online (the config's mode, else
    W&B's environment's) without an API key where W&B looks for one (its environment, .netrc, its settings).
    None: it would start, or this W&B cannot be asked (the rank then reports what it says)."""
    try:
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        environment = wandb_setup.singleton().settings
        mode, host = settings.mode or environment.mode, environment.base_url
    except Exception:  # another W&B's internals, or settings W&B refuses (its own start says why)
        return None
    if mode in ("offline", "disabled"):
        return None
    try:
        found = wbauth.authenticate_session(host=host, source="flodl", prompt=False, update_session=False)
    except Exception as err:  # a key it finds and refuses (its format)
        return f"W&B refuses its API key ({type(err).__name__}: {err})"
    return None if found is not None else "W&B has no API key, and it runs online"


class WandbSink:
    def __init__(
        self,
        settings: WandbSettings,
        info: RunInfo,
        config: dict[str, Any],
        policy: str,
        resumed: Resumed | None = None,
    ) -> None:
        self.run: Any = None
        self._cursor_path = Path(info.run_dir) / CURSOR_FILE
        self._cursor = Cursor.resumed(self._cursor_path) if resumed else Cursor()
        self._changes: list[dict[str, Any]] = []
        self._failed = False
        try:
            self._start(settings, info, config, policy, resumed)
        except Exception as err:
            cause = f"{type(err).__name__}: {err}".strip()
            if settings.required:
                raise WandbStartError(
                    f"W&B could not start ({cause}); fix that, or train without W&B: logger.required=false"
                ) from None
            log.warning("could not start the W&B run (%s); training goes on without W&B", cause)
            self._failed = True

    def _start(
        self,
        settings: WandbSettings,
        info: RunInfo,
        config: dict[str, Any],
        policy: str,
        resumed: Resumed | None,
    ) -> None:
        import wandb

        if resumed is None:  # a fresh start: an earlier start's cursor belongs to the history it moved aside
            self._cursor_path.unlink(missing_ok=True)
        self.run = wandb.init(
            **init_arguments(settings, info, policy),
            id=info.run_id,
            resume=None if resumed is None else "allow",  # None: W&B's default, a run begun
            config={**config, "flodl": info.as_dict()},
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        if resumed is not None and resumed.saved_world != resumed.world:
            resize = {"from": resumed.saved_world, "to": resumed.world, "epoch": resumed.epoch}
            self.run.summary["resize"] = resize
        self.run.define_metric("train/step")
        self.run.define_metric("epoch")
        self.run.define_metric("comm/bytes_total")
        for pattern in ("train/*", "eval/*", "rank*"):
            self.run.define_metric(pattern, step_metric="train/step")
        self.run.define_metric("epoch/*", step_metric="epoch")
        self.run.define_metric("comm/*", step_metric="comm/bytes_total")

    def progress(self, report: Progress) -> None:
        if not self._cursor.wants_progress(report.rank, report.step):  # an earlier start logged it
            return
        self._cursor.logged_progress(report.rank, report.step)
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
        if self._cursor.wants_epoch(metrics.epoch):  # else an earlier start logged it
            self._log_epoch(metrics)
        self._log_eval(metrics)

    def _log_epoch(self, metrics: EpochMetrics) -> None:
        row: dict[str, float] = {
            "epoch": metrics.epoch,
            "train/step": metrics.step,
            "epoch/loss": metrics.loss,
            "epoch/samples_per_s": metrics.samples_per_s,
            "epoch/epoch_s": metrics.epoch_s,
            "epoch/lr": metrics.lr,
            "epoch/rounds": metrics.rounds,
            "epoch/world": metrics.world,
            "epoch/data_wait": metrics.data_wait,
            "comm/bytes_total": metrics.comm_bytes_total,
            "comm/bytes": metrics.comm_bytes,
            "comm/loss": metrics.loss,
        }
        row.update({f"comm/eval_{name}": value for name, value in metrics.eval.items()})
        if metrics.eval_step is not None and metrics.eval_samples is not None:  # both come with an eval
            row["epoch/eval_step"], row["epoch/eval_samples"] = metrics.eval_step, metrics.eval_samples
        row.update({f"epoch/{name}": value for name, value in metrics.scalars.items()})
        if metrics.tokens_per_s is not None:
            row["epoch/tokens_per_s"] = metrics.tokens_per_s
        if metrics.mfu is not None:
            row["epoch/mfu"] = metrics.mfu
        if metrics.peak_memory:
            row["epoch/peak_memory_gib"] = metrics.peak_memory / 2**30
        for change in metrics.membership:  # fault_tolerance=survive: cuts and admissions, counted per epoch
            key = f"epoch/{change['event']}"
            row[key] = row.get(key, 0) + 1
        if metrics.membership:  # and each change in full, in the run's summary
            self._changes.extend(metrics.membership)
            self._guard(
                lambda: self.run.summary.update({"membership": list(self._changes)}), "W&B summary failed"
            )
        for share in metrics.per_rank:
            row[f"rank{share.rank}/batch_share"] = share.batch_share
            row[f"rank{share.rank}/epoch_samples_per_s"] = share.samples_per_s
            row[f"rank{share.rank}/data_ms"] = share.data_ms
            row[f"rank{share.rank}/averaging_blocked_ms"] = share.averaging_blocked_ms
            row[f"rank{share.rank}/averaging_comm_ms"] = share.averaging_comm_ms
        self._cursor.logged_epoch(metrics.epoch)
        self._log(row)

    def _log_eval(self, metrics: EpochMetrics) -> None:
        """The epoch's eval as a row of its own, at the step its model was taken, unless it was logged (async
        reports one eval for several epochs; an earlier start may have logged it)."""
        step = metrics.step if metrics.eval_at_step is None else metrics.eval_at_step
        if not metrics.eval or not self._cursor.wants_eval(step):
            return
        self._cursor.logged_eval(step)
        self._log({"train/step": step, **{f"eval/{name}": value for name, value in metrics.eval.items()}})

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
        """One row at the run's next `_step`, committed at once (a crash loses no row held back), then the
        cursor that says so (the row's own mark is set before)."""
        if self.run is not None:
            step = self._cursor.next_step()
            self._guard(lambda: self.run.log(row, step=step, commit=True), "W&B logging failed")
        if self.run is not None:
            self._guard(lambda: self._cursor.save(self._cursor_path), "W&B's cursor could not be written")

    def _guard(self, action: Callable[[], object], what: str) -> None:
        """Run `action`; on the first failure report it once and stop using W&B for this run."""
        try:
            action()
        except Exception as err:
            if not self._failed:
                log.warning("%s (%s: %s); training goes on without W&B", what, type(err).__name__, err)
            self._failed = True
            self.run = None
