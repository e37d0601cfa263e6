"""W&B sink, end to end: offline runs read back from disk with wandb's own reader (`wandb leet inspect`)."""

from __future__ import annotations

import itertools
import json
import logging
import random
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
    """Keep wandb's caches, settings and service inside the test, and away from any real account."""
    return {
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "WANDB_API_KEY": "",
        # A job's own wandb-core service, never one this process started for an earlier test (a start that
        # died leaves its run in use there).
        "WANDB_SERVICE": "",
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


def git_project(path: Path) -> str:
    """Make `path` a git repository with one commit, as a user's project is; its commit."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=path, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("-c", "user.name=u", "-c", "user.email=u@x", "commit", "-q", "--allow-empty", "-m", "start")
    return git("rev-parse", "HEAD").strip()


@pytest.mark.multiproc
def test_two_rank_job_is_one_run_with_train_and_eval_streams(tmp_path: Path) -> None:
    commit = git_project(tmp_path)
    train(
        "policy=cadence",
        "launch.nproc_per_node=2",
        FAST_START,
        "epochs=3",
        "logger=wandb",
        "logger.log_every=5",
        "hydra.run.dir=run",
        # Rank 0 dies in epoch 1 and the run goes on without it (its records live in the launcher's process,
        # the run's host): the membership change reaches W&B, and its streams go on.
        "fault_tolerance=survive",
        "simulate.kill_rank=0",
        "simulate.kill_at_step=30",
        cwd=tmp_path,
        WANDB_MODE="offline",  # W&B's own environment decides: the config sets no mode
        **wandb_env(tmp_path),
    ).check()
    runs = list((tmp_path / "run").glob("wandb/offline-run-*"))
    assert len(runs) == 1, runs  # one run per job, from the run's host only
    rows = records(runs[0])
    items = history(rows)
    train_steps = [i["train/step"] for i in items if "train/loss" in i]
    assert len(train_steps) >= 5 and train_steps == sorted(train_steps) and len(set(train_steps)) > 1
    evals = [i for i in items if "eval/accuracy" in i]
    eval_steps = [i["train/step"] for i in evals]  # one row per eval, at the step its consensus was taken
    assert len(eval_steps) == 3 and eval_steps == sorted(eval_steps) and eval_steps[-1] > 0
    assert all(0 < i["eval/accuracy"] <= 1 for i in evals)
    assert any("rank1/loss" in i for i in items)  # per-rank series
    assert [i["epoch"] for i in items if "epoch/loss" in i] == [0, 1, 2]  # every epoch once: no gap, no twin
    assert any(i.get("comm/bytes_total", 0) > 0 for i in items)
    worlds = [i["epoch/world"] for i in items if "epoch/world" in i]
    assert worlds[0] == 2 and worlds[-1] == 1, worlds
    assert sum(i.get("epoch/rank_cut", 0) for i in items) == 1
    run = run_record(rows)
    assert run["run_group"] == "run" or run["run_group"].endswith("run")
    assert run["job_type"] == "cadence"
    config = run["config"]["update"]
    assert config["policy"] == "cadence" and config["flodl"]["overrides"][0] == "policy=cadence"
    # Nested as composed, not flattened into dotted keys.
    assert config["logger"]["name"] == "wandb" and config["launch"]["nproc_per_node"] == 2
    assert config["task"]["model"]["_target_"].endswith("MLP") and "logger.name" not in config
    assert config["flodl"]["git_commit"] == commit  # the project the user ran from, not flodl's
    assert not leftovers(tmp_path)


@pytest.mark.multiproc
def test_multirun_jobs_share_the_sweeps_group_and_are_named_by_what_varies(tmp_path: Path) -> None:
    train(
        "-m",
        "seed=0,1",
        "epochs=1",
        "logger=wandb",
        "logger.mode=offline",
        "launch.timeout_s=60,60",  # a sweep of a launch.* key: never in a name
        cwd=tmp_path,
        **wandb_env(tmp_path),
    ).check()
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    runs = sorted(sweep.glob("*/wandb/offline-run-*"))
    assert len(runs) == 4
    infos = [run_record(records(run)) for run in runs]
    assert {i["run_group"] for i in infos} == {"/".join(sweep.parts[-2:])}
    assert len({i["run_id"] for i in infos}) == 4
    assert sorted(i["display_name"] for i in infos) == ["seed=0", "seed=0", "seed=1", "seed=1"]


@pytest.mark.multiproc
def test_wandb_failing_to_start_is_an_error_unless_not_required(tmp_path: Path) -> None:
    # Online mode without an API key: refused before any rank starts, with no run dir.
    args = ("epochs=2", "logger=wandb", "logger.mode=online")
    failed = train(*args, "hydra.run.dir=failed", cwd=tmp_path, apart=True, **wandb_env(tmp_path))
    assert failed.code == 2, failed.err[-4000:]
    assert "logger=wandb: W&B has no API key" in failed.err and "logger.required=false" in failed.err
    assert "Traceback" not in failed.out + failed.err and not (tmp_path / "failed").exists()
    # A key, and a server that does not answer: W&B fails in rank 0, and the others stop with it. One line
    # says why, naming rank 0; no rank's or launcher's traceback.
    unreachable = {"WANDB_API_KEY": "a" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9"}
    # W&B's wait for it: whatever fails wandb.init (refused, timed out) is the one WandbStartError.
    unreachable["WANDB_INIT_TIMEOUT"] = "1"
    ranks = train(
        *args,
        "launch.nproc_per_node=2",
        FAST_START,
        "hydra.run.dir=ranks",
        cwd=tmp_path,
        apart=True,
        **{**wandb_env(tmp_path), **unreachable},
    )
    assert ranks.code == 1, ranks.err[-4000:]
    lines = ranks.err.strip().splitlines()
    assert len(lines) == 1, ranks.err[-4000:]
    line = lines[0]
    assert line.startswith("flodl: rank 0 failed first (WandbStartError: W&B could not start ("), line
    assert "logger.required=false" in line and line.endswith(f"see {tmp_path / 'ranks' / 'rank0.log'}"), line
    assert "Traceback" not in ranks.out, ranks.out[-4000:]
    assert (
        "the run's host could not start the run: WandbStartError"
        in (tmp_path / "ranks" / "rank1.log").read_text()
    )
    optional = train(*args, "logger.required=false", "hydra.run.dir=run", cwd=tmp_path, **wandb_env(tmp_path))
    optional.check()
    assert optional.out.count("training goes on without W&B") == 1
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.multiproc
def test_an_eval_is_placed_at_the_step_its_model_was_taken(tmp_path: Path, monkeypatch) -> None:
    """Async: one eval, on the consensus of a round after epoch 1's end, stands for epochs 0 and 1. W&B
    plots it once, against `train/step` where its model was taken, as read back with wandb's own reader."""
    for key, value in wandb_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    info = RunInfo(str(tmp_path / "run"), "g", "n")
    (tmp_path / "run").mkdir()
    sink = WandbSink(WandbSettings(mode="offline"), info, {}, "async")
    late = {"eval": {"accuracy": 0.75}, "eval_step": 900, "eval_samples": 3600, "eval_at_step": 480}
    for epoch, step in ((0, 200), (1, 410)):
        sink.emit(EpochMetrics(epoch, step, 1.0, 800, 1.0, 800.0, **late))
    sink.emit(EpochMetrics(2, 620, 1.0, 800, 1.0, 800.0, eval={"accuracy": 0.8}, eval_at_step=620))
    sink.close()
    (run,) = (tmp_path / "run").glob("wandb/offline-run-*")
    items = history(records(run))
    evals = [(i["train/step"], i["eval/accuracy"]) for i in items if "eval/accuracy" in i]
    assert evals == [(480, 0.75), (620, 0.8)]
    assert [i["train/step"] for i in items if "epoch/loss" in i] == [200, 410, 620]


class FailingRun:
    def __init__(self) -> None:
        self.calls = 0

    def log(self, row: dict, step: int, commit: bool) -> None:
        self.calls += 1
        raise ConnectionError("wandb service went away")


@pytest.mark.multiproc
def test_a_failing_log_is_reported_once_and_then_skipped(caplog: pytest.LogCaptureFixture) -> None:
    sink = WandbSink(WandbSettings(mode="disabled"), RunInfo("/tmp/x", "g", "n"), {}, "sync")
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


def increasing(values: list) -> bool:
    return all(a < b for a, b in itertools.pairwise(values))


def summary(rows: list[dict]) -> dict:
    """The run's summary as the updates in its records leave it."""
    merged: dict = {}
    for row in rows:
        if row.get("type") == "summary":
            merged.update(row["summary"].get("update", {}))
    return merged


@pytest.mark.multiproc
def test_a_crashed_job_resumed_on_fewer_ranks_continues_its_run(tmp_path: Path) -> None:
    """Rank 1 is killed inside the last epoch, after the checkpoint of epoch 1: the job fails with epoch 2
    logged past its checkpoint. Resumed on one rank (resume=auto) it re-trains epochs 2 and 3. Read back
    with wandb's own reader, the two starts' offline dirs are one run: its id, `_step` going on across the
    starts, each epoch and each rank's progress step once, the second start marked resumed (W&B's `resume`)
    and its resize in the summary. The kill's step is drawn from a seed (printed) in the last epoch."""
    kill_at = random.Random(55).randint(67, 87)  # rank 1's steps: 22 an epoch on 2 ranks, epoch 3 from 67
    print(f"rank 1 killed at its step {kill_at}")
    common = ("policy=sync", "epochs=4", "checkpoint_every=2", "logger=wandb", "logger.log_every=5")
    env = {"WANDB_MODE": "offline", **wandb_env(tmp_path)}
    crashed = train(
        *common,
        "launch.nproc_per_node=2",
        FAST_START,
        "simulate.kill_rank=1",
        f"simulate.kill_at_step={kill_at}",
        "hydra.run.dir=run",
        cwd=tmp_path,
        **env,
    )
    assert crashed.code != 0, crashed.out[-4000:]
    train(*common, "launch.nproc_per_node=1", "hydra.run.dir=run", "resume=auto", cwd=tmp_path, **env).check()
    starts = [records(run) for run in (tmp_path / "run").glob("wandb/offline-run-*")]
    starts.sort(key=lambda rows: run_record(rows)["start_time"])
    assert len(starts) == 2, starts
    first, resumed = (run_record(rows) for rows in starts)
    assert first["run_id"] == resumed["run_id"]
    assert not first.get("resume") and resumed.get("resume") is True  # W&B resumes the run on sync
    items = [item for rows in starts for item in history(rows)]
    steps = [i["_step"] for i in items]
    assert increasing(steps), steps  # across the starts
    assert [i["epoch"] for i in items if "epoch/loss" in i] == [0, 1, 2, 3]  # each epoch once
    progress = [i["train/step"] for i in items if "train/loss" in i]  # rank 0's, each step once, in order
    assert increasing(progress), progress
    assert [i["epoch/world"] for i in items if "epoch/loss" in i][-1] == 1
    assert summary(starts[1])["resize"] == {"from": 2, "to": 1, "epoch": 2}
    assert not leftovers(tmp_path)
