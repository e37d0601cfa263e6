"""A multirun's whole grid checked before its first job trains (hydra_plugins/flodl_sweeper)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flodl.metrics.compare import report
from tests.helpers.procs import train

GRID = ("-m", "policy=sync,cadence,async", "gamma=0.5,1.0", "seed=0,1", "epochs=1", "eval_every=0")
# policy=sync refuses gamma != 1.0: the grid's jobs 0 and 1 (sync, gamma=0.5, seeds 0 and 1).
INVALID = [["policy=sync", "gamma=0.5", "seed=0"], ["policy=sync", "gamma=0.5", "seed=1"]]
RULE = "gamma=0.5: applies to local SGD (policy=cadence or async)"


@pytest.mark.multiproc
def test_invalid_jobs_are_named_before_any_job_trains(tmp_path: Path) -> None:
    result = train(*GRID, cwd=tmp_path)
    assert result.code == 2, result.out
    assert "flodl: 2 of 12 sweep jobs are invalid:" in result.out
    for index, overrides in enumerate(INVALID):
        assert f"  job {index} ({' '.join(overrides)} epochs=1 eval_every=0): {RULE}" in result.out
    assert "nothing was trained; hydra.sweeper.skip_invalid=true runs the 10 valid ones" in result.out
    assert "Traceback" not in result.out
    assert not (tmp_path / "multirun").exists()  # no sweep dir, no job dir


@pytest.mark.multiproc
def test_skip_invalid_runs_the_valid_jobs_and_lists_the_others(tmp_path: Path) -> None:
    result = train(*GRID, "hydra.sweeper.skip_invalid=true", "task.train_data.split=test", cwd=tmp_path)
    result.check()
    (sweep_dir,) = [p.parent for p in (tmp_path / "multirun").rglob("multirun.yaml")]
    skipped = json.loads((sweep_dir / "skipped.json").read_text())
    assert [(s["job"], s["overrides"][:3]) for s in skipped] == list(enumerate(INVALID))
    assert all(s["problems"][0].startswith(RULE) for s in skipped)
    assert "skipping them (listed in" in result.out
    trained = sorted(p.parent for p in sweep_dir.rglob("metrics.jsonl"))
    # Each job dir is named by the job's place in the grid: skipped.json's numbers are no job dir's.
    assert sorted(int(p.name) for p in trained) == list(range(2, 12))
    ran = [yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())[:3] for job in trained]
    assert not [job for job in ran if job in INVALID]
    assert f"Skipped as invalid (2): `{' '.join(INVALID[0])}" in report(sweep_dir)
