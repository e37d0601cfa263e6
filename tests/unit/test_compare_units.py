"""flodl.metrics.compare's grouping, on jobs built in memory, and its report on job dirs written here (the
real sweep is in test_reports.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from flodl.metrics import run_clock
from flodl.metrics.compare import REPORT_MD, REPORT_PNG, report
from flodl.metrics.plots import plot_compare
from flodl.metrics.sweep import Job, group_jobs, mean_std, varying_keys


def job(name: str, overrides: dict[str, str], config: dict) -> Job:
    return Job(Path(name), overrides, config, records=[], times={})


def test_only_keys_that_differ_vary_and_an_unset_key_takes_the_config_value() -> None:
    config = {"policy": "sync", "gamma": 1.0, "seed": 42, "epochs": 3}
    jobs = [
        job("0", {"policy": "cadence", "seed": "0", "epochs": "3"}, config),
        job("1", {"policy": "cadence", "seed": "1", "epochs": "3", "gamma": "0.5"}, config),
        job("2", {"policy": "async", "seed": "0", "epochs": "3", "gamma": "1.0"}, config),
        job("3", {"policy": "async", "seed": "1", "epochs": "3", "gamma": "1.0"}, config),
    ]
    # epochs is the same everywhere; job 0 leaves gamma at its config value, 1.0, as jobs 2 and 3 set it.
    assert varying_keys(jobs) == ["policy", "seed", "gamma"]
    groups = group_jobs(jobs)
    assert [g.label for g in groups] == [
        "policy=cadence gamma=1.0",
        "policy=cadence gamma=0.5",
        "policy=async gamma=1.0",
    ]
    assert [[j.dir.name for j in g.jobs] for g in groups] == [["0"], ["1"], ["2", "3"]]


def test_a_sweep_over_seeds_only_is_one_group() -> None:
    jobs = [job(str(s), {"seed": str(s)}, {"seed": 42}) for s in range(3)]
    (group,) = group_jobs(jobs)
    assert group.label == "all jobs" and len(group.jobs) == 3


def test_spread_is_the_sample_standard_deviation() -> None:
    assert mean_std([1.0, 3.0]) == (2.0, 2**0.5)
    assert mean_std([5.0]) == (5.0, 0.0)


def async_job(name: str, at: float) -> Job:
    """Two epochs of 1408 samples each; each eval ran on a consensus taken after its epoch's end."""
    epoch = {"loss": 1.0, "samples": 1408, "epoch_s": 2.0, "samples_per_s": 704.0, "comm_bytes_total": 10}
    records = [
        {**epoch, "epoch": 0, "eval/accuracy": 0.5, "eval_samples": 3968, "eval_taken_at": at + 9.0},
        {**epoch, "epoch": 1, "eval/accuracy": 0.7, "eval_samples": 4224, "eval_taken_at": at + 10.0},
    ]
    times = {"launched_at": at, "training_started_at": at + 5.0}
    return Job(Path(name), {"seed": name}, {"seed": 42}, records, times)


def test_an_eval_is_plotted_where_its_model_was_taken(tmp_path: Path) -> None:
    groups = group_jobs([async_job("0", 1000.0), async_job("1", 2000.0)])
    figure = plot_compare(groups, "eval/accuracy", tmp_path / "compare.png")
    by_wall, by_samples, speed = figure.axes[:3]
    ((line,),) = [by_wall.get_lines()]
    assert list(line.get_xdata()) == [9.0, 10.0]  # seconds since launch when each eval's model was taken
    assert list(by_samples.get_lines()[0].get_xdata()) == [3968, 4224]
    assert list(speed.get_lines()[0].get_xdata()) == [0, 1]  # per-epoch figures stay at their epoch


def test_a_sweeps_own_start_up_is_charged_to_no_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process walking a sweep starts (interpreter, Hydra, the grid check) before job 0 is launched:
    job 0's wall time starts once the grid is checked, and the sweep's start-up is written apart."""
    monkeypatch.setattr(run_clock, "_next_launch", None)
    checked = time.time()
    run_clock.sweep_ready(tmp_path)
    first = run_clock.launch_time()
    assert first >= checked
    sweep = json.loads((tmp_path / run_clock.SWEEP_FILE).read_text())
    assert sweep["launched_at"] < sweep["jobs_started_at"] == first
    assert run_clock.sweep_startup_s(tmp_path) == sweep["jobs_started_at"] - sweep["launched_at"]
    job = tmp_path / "0"
    job.mkdir()
    run_clock.record_exit(job, first)
    assert run_clock.launch_time() == json.loads((job / run_clock.RUN_FILE).read_text())["exited_at"]
    assert run_clock.sweep_startup_s(job) is None


def test_a_job_launched_by_its_launcher_starts_when_the_launcher_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(run_clock, "_next_launch", None)
    monkeypatch.setenv(run_clock.LAUNCHED_AT_ENV, "1234.5")
    assert run_clock.launch_time() == 1234.5


def sweep_job(sweep: Path, name: str, overrides: list[str], records: list[dict] | None) -> Path:
    """A job dir as Hydra and flodl leave it: its overrides and config; its metrics.jsonl (None: none)."""
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"policy": "sync", "seed": 42}))
    if records is not None:
        (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return job


def test_a_failed_job_is_listed_with_its_launchers_line_and_the_rest_are_compared(tmp_path: Path) -> None:
    epoch = {"epoch": 0, "loss": 0.5, "samples": 64, "epoch_s": 1.0, "samples_per_s": 64.0, "rounds": 2}
    epoch["comm_bytes_total"] = 8
    for seed in ("0", "1"):
        job = sweep_job(tmp_path, seed, ["policy=cadence", f"seed={seed}"], [epoch])
        run_clock.record_exit(job, 100.0)
    failed = sweep_job(tmp_path, "2", ["policy=async", "seed=0"], [])  # the host opened metrics.jsonl
    line = "rank 1 failed first (ValueError: task.model: boom); no checkpoint was written; see x/rank1.log"
    run_clock.record_exit(failed, 100.0, failed=line)
    late = sweep_job(tmp_path, "3", ["policy=async", "seed=1"], [epoch, {**epoch, "epoch": 1}])
    run_clock.record_exit(late, 100.0, failed="rank 0 failed (RuntimeError: lost)")  # a part of a run
    sweep_job(tmp_path, "4", ["policy=async", "seed=2"], None)  # killed before it wrote anything
    text = report(tmp_path)
    assert "2 jobs in 1 group(s)" in text, text
    assert "| all jobs | 2 | 0.5000 ± 0.0000 |" in text, text  # the two that trained to their end
    assert "## Not compared (3)" in text
    assert f"- `2` (`policy=async seed=0`) failed: {line}" in text
    assert "- `3` (`policy=async seed=1`) failed: rank 0 failed (RuntimeError: lost)" in text
    assert "- `4` (`policy=async seed=2`) recorded no epoch and no failure" in text
    assert (tmp_path / REPORT_MD).read_text() == text and (tmp_path / REPORT_PNG).is_file()
