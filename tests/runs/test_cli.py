"""The CLI contract, end to end: real Hydra, real torchrun, real elastic launcher, gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flodl.tasks.digits import digits_dataset
from tests.helpers.procs import FAST_START, PYTHON, leftovers, run, torchrun, train
from tests.helpers.runs import assert_complete_run, epochs_of, only_run_dir

pytestmark = pytest.mark.multiproc

SHORT = ("epochs=2",)


def test_default_run_reaches_95_percent_test_accuracy(tmp_path: Path) -> None:
    result = train(cwd=tmp_path).check()
    run_dir = only_run_dir(tmp_path / "outputs")
    records = assert_complete_run(run_dir, world=1, epochs=15)
    assert records[-1]["eval/accuracy"] >= 0.95, records[-1]
    # Training made progress and the loss is reported batch-weighted per epoch.
    assert records[-1]["loss"] < records[0]["loss"] / 4
    assert "eval/accuracy" in result.out
    assert not leftovers(tmp_path)


def test_torchrun_two_ranks_share_one_run_dir(tmp_path: Path) -> None:
    # No hydra.run.dir override: the ranks agree on the timestamped dir through the store.
    torchrun(2, *SHORT, cwd=tmp_path).check()
    run_dir = only_run_dir(tmp_path / "outputs")
    assert len(list((tmp_path / "outputs").glob("*/*"))) == 1
    records = assert_complete_run(run_dir, world=2, epochs=2)
    # Global batch 2 x 32: whole steps per epoch, each rank half the batches.
    assert records[-1]["step"] == 2 * (len(digits_dataset("train")) // 64)
    assert [r["batch_share"] for r in records[-1]["per_rank"]] == [0.5, 0.5]
    assert not leftovers(tmp_path)


def test_self_launch_two_ranks(tmp_path: Path) -> None:
    result = train("launch.nproc_per_node=2", FAST_START, *SHORT, cwd=tmp_path).check()
    run_dir = only_run_dir(tmp_path / "outputs")
    records = assert_complete_run(run_dir, world=2, epochs=2)
    assert records[-1]["step"] == 2 * (len(digits_dataset("train")) // 64)
    assert "[r1]" in result.out
    assert not leftovers(tmp_path)


def test_config_error_stops_before_any_rank_starts(tmp_path: Path) -> None:
    typo = "callbacks=[{_target_:flodl.callbacks.BestModle}]"
    result = train("vram_max_usage=1.5", "batch_size=0", typo, "launch.nproc_per_node=2", cwd=tmp_path)
    assert result.code == 2, result.out
    assert "vram_max_usage=1.5: must be in [0.5, 0.99]" in result.out
    assert "batch_size=0: must be >= 1" in result.out
    assert (
        "callbacks[0]._target_='flodl.callbacks.BestModle': does not import "
        "(AttributeError: module 'flodl.callbacks' has no attribute 'BestModle')"
    ) in result.out
    assert "Traceback" not in result.out
    # Nothing was spawned: no rank ever logged and the launcher never ran.
    assert not list(tmp_path.rglob("rank*.log"))
    assert not list(tmp_path.rglob(".launch"))


def test_ranks_with_different_configs_refuse_to_train(tmp_path: Path) -> None:
    # Each rank resolves its own RANK into the seed: the composed configs differ.
    result = torchrun(2, "seed=${oc.env:RANK}", *SHORT, cwd=tmp_path)
    assert result.code != 0
    assert "rank 1 composed a different config than rank 0" in result.out
    assert "seed (rank 0: 0, other: 1)" in result.out
    assert not list(tmp_path.rglob("metrics.jsonl")) or not epochs_of(only_run_dir(tmp_path / "outputs"))
    assert not leftovers(tmp_path)


def test_epoch_without_a_full_batch_is_a_config_error(tmp_path: Path) -> None:
    result = train("batch_size=5000", cwd=tmp_path)
    assert result.code != 0
    picks = len(digits_dataset("train"))
    assert f"batch_size=5000: 1 rank(s) x 5000 exceeds the {picks} training picks" in result.out


def test_multirun_sweep_runs_each_job(tmp_path: Path) -> None:
    train("-m", "seed=0,1", "epochs=1", cwd=tmp_path).check()
    jobs = sorted(p.parent for p in (tmp_path / "multirun").rglob("metrics.jsonl"))
    assert [p.name for p in jobs] == ["0", "1"]
    for job in jobs:
        assert_complete_run(job, world=1, epochs=1)
    seeds = [yaml.safe_load((job / ".hydra" / "config.yaml").read_text())["seed"] for job in jobs]
    assert seeds == [0, 1]


@pytest.mark.multiproc
def test_a_run_s_processes_import_no_heavy_module_they_do_not_use(tmp_path: Path) -> None:
    # Every process of a run (the launcher, each spawned rank, a restart) imports these modules and loads the
    # default task. scikit-learn (to read the digits) and torch's FSDP2 and checkpoint modules (for sharded
    # groups only) took over a second each there.
    code = (
        "import sys; import flodl.launcher.launch, flodl.job.rank, flodl.job.assembly; "
        "from flodl.tasks.digits import digits_dataset; digits_dataset('train'); "
        "heavy = ('sklearn', 'torch.distributed.fsdp', 'torch.distributed.checkpoint'); "
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))"
    )
    result = run([PYTHON, "-c", code], cwd=tmp_path, timeout=120).check()
    assert result.out.strip() == "[]"
