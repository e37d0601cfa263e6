"""W&B sink, end to end: offline runs read back from disk with wandb's own reader (`wandb leet inspect`)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from flodl.metrics.aggregate import EpochMetrics
from flodl.metrics.run_info import RunInfo
from flodl.metrics.wandb_sink import WandbSettings, WandbSink
from tests.helpers.procs import FAST_START, child_env, leftovers, train

WANDB = str(Path(sys.executable).with_name("wandb"))


def wandb_env(tmp_path: Path) -> dict[str, str]:
    """Keep wandb's caches and settings inside the test dir, and away from any real account."""
    return {
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "WANDB_API_KEY": "",
        "HOME": str(tmp_path),
    }


def records(run: Path) -> list[dict]:
    out = subprocess.run(
        [WANDB, "leet", "inspect", "--json", str(run)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=child_env(),
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def history(rows: list[dict]) -> list[dict]:
    return [r["history"]["item"] for r in rows if r.get("type") == "history"]


def run_record(rows: list[dict]) -> dict:
    (run,) = [r["run"] for r in rows if r.get("type") == "run"]
    return run


@pytest.mark.multiproc
def test_two_rank_job_is_one_run_with_train_and_eval_streams(tmp_path: Path) -> None:
    train(
        "policy=cadence",
        "launch.nproc_per_node=2",
        FAST_START,
        "epochs=3",
        "logger=wandb",
        "logger.mode=offline",
        "logger.log_every=5",
        "hydra.run.dir=run",
        cwd=tmp_path,
        **wandb_env(tmp_path),
    ).check()
    runs = list((tmp_path / "run").glob("wandb/offline-run-*"))
    assert len(runs) == 1, runs  # one run per job, from rank 0 only
    rows = records(runs[0])
    items = history(rows)
    train_steps = [i["train/step"] for i in items if "train/loss" in i]
    assert len(train_steps) >= 5 and train_steps == sorted(train_steps) and len(set(train_steps)) > 1
    evals = [i for i in items if "eval/accuracy" in i]
    assert [i["epoch"] for i in evals] == [0, 1, 2]
    assert all(0 < i["eval/accuracy"] <= 1 for i in evals)
    assert any("rank1/loss" in i for i in items)  # per-rank series
    assert any(i.get("comm/bytes_total", 0) > 0 for i in items)
    run = run_record(rows)
    assert run["run_group"] == "run" or run["run_group"].endswith("run")
    assert run["job_type"] == "cadence"
    config = run["config"]["update"]
    assert config["policy"] == "cadence" and config["flodl"]["overrides"][0] == "policy=cadence"
    assert not leftovers(tmp_path)


@pytest.mark.multiproc
def test_multirun_jobs_share_one_group(tmp_path: Path) -> None:
    train(
        "-m",
        "seed=0,1",
        "epochs=1",
        "logger=wandb",
        "logger.mode=offline",
        cwd=tmp_path,
        **wandb_env(tmp_path),
    ).check()
    runs = sorted((tmp_path / "multirun").glob("*/*/*/wandb/offline-run-*"))
    assert len(runs) == 2
    infos = [run_record(records(run)) for run in runs]
    assert infos[0]["run_group"] == infos[1]["run_group"]
    assert infos[0]["run_id"] != infos[1]["run_id"]
    # Named after Hydra's override dirname: every override of the job.
    assert {i["display_name"] for i in infos} == {
        f"epochs=1,logger.mode=offline,logger=wandb,seed={seed}" for seed in (0, 1)
    }


@pytest.mark.multiproc
def test_unusable_wandb_costs_nothing_but_one_warning(tmp_path: Path) -> None:
    # Online mode without an API key: wandb refuses at init; training must go on.
    result = train(
        "epochs=2",
        "logger=wandb",
        "logger.mode=online",
        "hydra.run.dir=run",
        cwd=tmp_path,
        **wandb_env(tmp_path),
    )
    result.check()
    assert result.out.count("training goes on without W&B") == 1
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


class FailingRun:
    def __init__(self) -> None:
        self.calls = 0

    def log(self, row: dict) -> None:
        self.calls += 1
        raise ConnectionError("wandb service went away")


def test_a_failing_log_is_reported_once_and_then_skipped(caplog: pytest.LogCaptureFixture) -> None:
    sink = WandbSink(WandbSettings("disabled", "flodl", None, ()), RunInfo("/tmp/x", "g", "n"), {}, "sync")
    failing = FailingRun()
    sink.run = failing
    metrics = EpochMetrics(epoch=0, step=1, loss=1.0, samples=1, epoch_s=1.0, samples_per_s=1.0)
    with caplog.at_level(logging.WARNING, logger="flodl"):
        sink.emit(metrics)
        sink.emit(metrics)
        sink.close()
    assert failing.calls == 1
    assert [r.getMessage() for r in caplog.records if "without W&B" in r.getMessage()] == [
        "W&B logging failed (ConnectionError: wandb service went away); training goes on without W&B"
    ]
