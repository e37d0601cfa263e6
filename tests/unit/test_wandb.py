"""W&B sink in-process: the job's name, and its run across the job's starts (wandb.init stood in for)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flodl.links.messages import Progress
from flodl.metrics.aggregate import EpochMetrics
from flodl.metrics.run_info import RunInfo, job_name, sweep_keys
from flodl.metrics.wandb_sink import Resumed, WandbSettings, WandbSink


def test_a_jobs_name_holds_only_what_its_sweep_varies(tmp_path: Path) -> None:
    saved = tmp_path / "multirun.yaml"  # as Hydra's sweeper saves it in the sweep dir
    saved.write_text(
        "hydra:\n"
        "  overrides:\n"
        "    task: ['policy=sync,async', epochs=2, logger=wandb, 'launch.timeout_s=60,90']\n"
        "  sweeper:\n"
        "    params: {seed: '0,1', +task.model.width: 'range(2)'}\n"
    )
    varying = sweep_keys(saved)
    assert varying == {"policy", "launch.timeout_s", "seed", "task.model.width"}
    job = ["policy=async", "epochs=2", "logger=wandb", "launch.timeout_s=90", "seed=1", "+task.model.width=1"]
    assert job_name(job, varying) == "policy=async,seed=1,task.model.width=1"
    assert sweep_keys(tmp_path / "missing.yaml") == set()


class Died(BaseException):
    """The run's host killed: no handler of the sink's sees it (it guards against Exception)."""


@dataclass
class Job:
    """What W&B holds of one job: every row its starts logged (`_step`, row), the rows a death cut between
    W&B and the sink's cursor (those alone may be logged twice), and the death to come."""

    rows: list[tuple[int, dict]] = field(default_factory=list)
    cut: list[dict] = field(default_factory=list)
    # Each start's `resume` (wandb.init's argument).
    resumes: list[object] = field(default_factory=list)
    # The log call (counted over the job) the host dies at, and whether before W&B took its row.
    dies_at: int | None = None
    before: bool = True
    calls: int = 0


class Run:
    """wandb.init's run as far as the sink uses it, logging into the job's rows."""

    def __init__(self, job: Job) -> None:
        self.job, self.summary = job, dict[str, object]()

    def define_metric(self, *args: object, **kwargs: object) -> None:
        pass

    def log(self, row: dict, step: int, commit: bool) -> None:
        job = self.job
        job.calls += 1
        dies = job.calls == job.dies_at
        if dies and job.before:
            raise Died
        job.rows.append((step, row))
        if dies:
            job.cut.append(row)
            raise Died

    def finish(self) -> None:
        pass


EPOCHS, STEPS, EVERY, RANKS = 6, 10, 3, 2  # checkpoints after epochs 1, 3, 5


def one_start(sink: WandbSink, first: int, rng: random.Random, done: list[int]) -> None:
    """The epochs from `first`: each rank's progress every EVERY steps (the ranks' order drawn), then the
    epoch's record with its eval; `done` gets each epoch whose record the sink took (a checkpoint after
    it commits only then)."""
    for epoch in range(first, EPOCHS):
        for step in range(epoch * STEPS + 1, (epoch + 1) * STEPS + 1):
            if step % EVERY == 0:
                for rank in rng.sample(range(RANKS), RANKS):
                    sink.progress(Progress(rank, epoch, step, 1.0, 1.0, 0.1))
        end = (epoch + 1) * STEPS
        sink.emit(EpochMetrics(epoch, end, 1.0, 8, 1.0, 8.0, eval={"accuracy": 0.5}, eval_at_step=end))
        done.append(epoch)


def test_a_job_killed_anywhere_and_resumed_logs_each_row_once_at_increasing_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deaths drawn from a seed: a job's host dies before or after a row reaches W&B, up to three times, and
    resumes from its last checkpoint. What W&B holds at the end: `_step` strictly increasing over every
    start, every epoch, eval and rank's progress step logged, and each once but for a row cut between W&B
    and the cursor; each start after the first resumed."""
    import wandb

    rng = random.Random(55)
    rows_per_start = EPOCHS * (STEPS // EVERY * RANKS + 2)
    for trial in range(40):
        job, run_dir = Job(), tmp_path / str(trial)
        run_dir.mkdir()

        def init(job: Job = job, **arguments: object) -> Run:
            job.resumes.append(arguments.get("resume"))
            return Run(job)

        monkeypatch.setattr(wandb, "init", init)
        first, resumed, expected = 0, None, list[object]()
        for start in range(4):
            expected.append(None if resumed is None else "allow")
            job.dies_at = job.calls + rng.randint(1, rows_per_start) if start < 3 else None
            job.before = rng.random() < 0.5
            sink = WandbSink(WandbSettings(), RunInfo(str(run_dir), "g", "n"), {}, "sync", resumed)
            done: list[int] = []
            try:
                one_start(sink, first, rng, done)
                break
            except Died:
                checkpoints = [e for e in done if e % 2 == 1]
                if not checkpoints:  # none yet: a fresh start, which begins the history anew
                    first, resumed, job.rows, job.cut = 0, None, [], []
                    continue
                first, resumed = checkpoints[-1] + 1, Resumed(checkpoints[-1] + 1, RANKS, RANKS)
        steps = [step for step, _ in job.rows]
        assert steps == sorted(set(steps)), (trial, steps)
        rows = [row for _, row in job.rows if row not in job.cut] + job.cut
        epochs = sorted(row["epoch"] for row in rows if "epoch/loss" in row)
        evals = sorted(row["train/step"] for row in rows if "eval/accuracy" in row)
        progress = sorted(
            (rank, row["train/step"]) for row in rows for rank in range(RANKS) if loss(row, rank)
        )
        assert epochs == list(range(EPOCHS)), (trial, epochs)
        assert evals == [(e + 1) * STEPS for e in range(EPOCHS)], (trial, evals)
        wanted = [(r, s) for r in range(RANKS) for s in range(EVERY, EPOCHS * STEPS + 1, EVERY)]
        assert progress == wanted, (trial, progress)
        assert job.resumes == expected


def loss(row: dict, rank: int) -> bool:
    return ("train/loss" if rank == 0 else f"rank{rank}/loss") in row
