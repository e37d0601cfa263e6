"""The data plane end to end: two gloo ranks on a task whose data does not fit the RAM budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.procs import leftovers, torchrun
from tests.helpers.runs import epochs_of, only_run_dir

pytestmark = pytest.mark.multiproc


def test_async_two_ranks_stage_to_disk_and_leave_no_pack_file(tmp_path: Path):
    stage = tmp_path / "stage"
    stage.mkdir()
    torchrun(
        2,
        "policy=async",
        "disk_stage_gb=8",
        f"disk_stage_dir={stage}",
        "task=npy_blobs",
        "ram_max_usage=0.0000001",
        "epochs=2",
        "device=cpu",
        f"+task.train_data.folder={tmp_path / 'data'}",
        "+task.train_data.samples=3000",
        f"+task.eval_data.folder={tmp_path / 'data'}",
        "+task.eval_data.samples=3000",
        cwd=tmp_path,
        timeout=240,
    ).check()
    run_dir = only_run_dir(tmp_path / "outputs")
    records = epochs_of(run_dir)
    epochs = [r for r in records if "data/hits_disk" in r.get("scalars", {})]
    assert len(epochs) == 2, records
    assert epochs[-1]["scalars"]["data/hits_disk"] > 0  # the second epoch reads what the first staged
    assert epochs[-1]["eval/accuracy"] > 0.3
    log = (run_dir / "rank1.log").read_text()
    assert "staging tiers: RAM" in log and "flodl-stage-" in log
    assert list(stage.iterdir()) == []  # every pack file removed at exit
    assert not leftovers(tmp_path)


def test_data_plane_benchmark_smoke(tmp_path: Path):
    from tests.helpers.procs import PYTHON, REPO, run

    out = run(
        [PYTHON, str(REPO / "bench" / "data_plane.py"), "--quick", "--dir", str(tmp_path)], cwd=tmp_path
    )
    out.check()
    assert "| 3 |" in out.out and "disk tier read" in out.out
    assert list(tmp_path.iterdir()) == []  # source and pack file gone
