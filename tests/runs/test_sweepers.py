"""flodl under the sweepers and launchers users bring (issue 41): Optuna reads each job's objective, a failed
job is a failed trial, joblib's workers start ranks, a config error of the whole sweep stops it first."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from tests.helpers.procs import FAST_START, leftovers, torchrun, train
from tests.helpers.runs import assert_complete_run

SMALL = ("task.train_data.split=test", "epochs=1", "eval_every=1")


def _job_dirs(root: Path) -> list[Path]:
    return sorted(p.parent.parent for p in root.rglob(".hydra/overrides.yaml") if p.parent.parent != root)


@pytest.mark.multiproc
def test_an_optuna_study_gets_each_trials_metric_and_counts_a_diverging_trial_failed(tmp_path: Path) -> None:
    lrs = "0.05,0.1,1e20"  # the last diverges: a NaN loss, on_nonfinite=error ends its job
    result = train(
        "-m",
        "hydra/sweeper=optuna",
        # Random at a seed that draws each value once (Optuna's grid sampler breaks on a failed last trial:
        # its study.stop() raises outside an objective, in hydra-optuna-sweeper's failure path).
        "hydra/sweeper/sampler=random",
        "hydra.sweeper.sampler.seed=2",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.n_jobs=3",  # one batch: its failure rate 1/3 is under max_failure_rate
        "hydra.sweeper.direction=maximize",
        "hydra.sweeper.max_failure_rate=0.5",
        f"task.optimizer.lr=choice({lrs})",
        "objective=eval/accuracy",
        "launch.nproc_per_node=2",  # the objective of N ranks: what rank 0's host recorded
        FAST_START,
        *SMALL,
        cwd=tmp_path,
        timeout=420,
    )
    result.check()
    # Optuna's sweeper logs each failed trial and goes on (max_failure_rate); SystemExit would have ended it.
    failed = [line for line in result.out.splitlines() if "Failed experiment:" in line]
    assert all("non-finite" in line for line in failed), failed
    recorded, diverged = {}, 0
    for job in _job_dirs(tmp_path / "multirun"):
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        lr = float(next(o for o in overrides if o.startswith("task.optimizer.lr=")).split("=")[1])
        if lr < 1:
            last = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()][-1]
            recorded[lr] = last["eval/accuracy"]
        else:
            diverged += 1
    assert len(failed) == diverged >= 1 and recorded  # the seed's draws have both
    (results,) = (tmp_path / "multirun").rglob("optimization_results.yaml")
    best = yaml.safe_load(results.read_text())
    assert best["best_value"] == max(recorded.values())
    assert best["best_params"]["task.optimizer.lr"] == max(recorded, key=recorded.__getitem__)
    assert "SystemExit" not in result.out


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("epochs=0", "epochs=0"),
        ("objective=eval/acc", "objective='eval/acc': the run's eval records no such metric"),  # its task's
    ],
)
def test_a_config_error_of_the_whole_sweep_exits_2_before_any_job(
    override: str, named: str, tmp_path: Path
) -> None:
    result = train(
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "task.optimizer.lr=interval(0.01,0.5)",
        override,
        cwd=tmp_path,
    )
    assert result.code == 2, result.out
    assert named in result.out and "(in every job of this sweep)" in result.out
    assert not list((tmp_path / "multirun").rglob("metrics.jsonl"))


@pytest.mark.multiproc
def test_joblib_workers_start_each_jobs_ranks(tmp_path: Path) -> None:
    """loky workers have no 'loky' start method of torch's multiprocessing: the ranks start where they can."""
    result = train(
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "launch.nproc_per_node=2",
        "seed=0",  # one job: two side by side are the slots and submitit launchers' tests
        *SMALL,
        cwd=tmp_path,
        timeout=300,
    )
    result.check()
    (job,) = _job_dirs(tmp_path / "multirun")
    records = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["epoch"] == 0 and math.isfinite(records[-1]["eval/loss"])
    assert (job / "rank1.log").is_file()


@pytest.mark.multiproc
def test_torchrun_ranks_run_the_trials_rank_0s_optuna_draws(tmp_path: Path) -> None:
    """Under torchrun every rank walks the sweep: rank 0's sampler draws each trial (no seed set: ranks
    drawing their own would compose different configs) and the other ranks run the same jobs."""
    result = torchrun(
        2,
        "-m",
        "hydra/sweeper=optuna",  # TPE, no seed
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.n_jobs=2",  # a batch of two, then one
        "hydra.sweeper.direction=maximize",
        "task.optimizer.lr=interval(0.005,0.05)",  # none diverges
        "objective=eval/accuracy",
        *SMALL,
        cwd=tmp_path,
        timeout=420,
    )
    result.check()
    assert "Failed experiment" not in result.out, result.out
    assert result.out.count("#0 : ") == 1  # Hydra's launcher lines are rank 0's alone
    jobs = _job_dirs(tmp_path / "multirun")
    assert [job.name for job in jobs] == ["0", "1", "2"]
    accuracy = {}
    for job in jobs:
        records = assert_complete_run(job, world=2, epochs=1)
        (lr,) = [o for o in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) if "lr=" in o]
        accuracy[lr] = records[-1]["eval/accuracy"]
    (results,) = (tmp_path / "multirun").rglob("optimization_results.yaml")
    best = yaml.safe_load(results.read_text())
    assert best["best_value"] == max(accuracy.values())
    assert f"task.optimizer.lr={best['best_params']['task.optimizer.lr']}" == max(accuracy, key=accuracy.get)
    assert not leftovers(tmp_path)
