"""Checkpoint files on disk: only complete, intact checkpoints are ever picked to resume from."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from flodl.checkpoint import (
    COORDINATOR_FILE,
    LATEST_FILE,
    MODEL_FILE,
    CheckpointDir,
    CheckpointError,
    rank_file,
    resolve_resume,
)
from flodl.resume import check_world_size, truncate_history


def write_checkpoint(store: CheckpointDir, epoch: int, world_size: int = 2, commit: bool = True) -> None:
    store.write_part(epoch, MODEL_FILE, {"w": torch.full((64,), float(epoch))})
    store.write_part(epoch, COORDINATOR_FILE, {"epoch": epoch})
    for rank in range(world_size):
        store.write_part(epoch, rank_file(rank), {"rank": rank, "epoch": epoch})
    if commit:
        store.commit(epoch, world_size)


def test_a_committed_checkpoint_is_latest_and_loads_with_weights_only(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    write_checkpoint(store, 1)
    found = store.latest()
    assert found is not None and (found.epoch, found.world_size) == (1, 2)
    assert torch.equal(found.load(MODEL_FILE)["w"], torch.full((64,), 1.0))
    assert (store.root / LATEST_FILE).read_text() == found.path.name


def test_a_checkpoint_interrupted_mid_write_is_never_latest(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=3)
    write_checkpoint(store, 1)
    write_checkpoint(store, 2, commit=False)  # the ranks wrote their parts, the commit never happened
    assert store.latest().epoch == 1


def test_a_truncated_file_in_the_newest_checkpoint_falls_back_to_the_one_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointDir(tmp_path, keep=3)
    write_checkpoint(store, 1)
    write_checkpoint(store, 2)
    victim = store.root / "epoch-000002" / rank_file(1)
    victim.write_bytes(victim.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING, logger="flodl"):
        found = store.latest()
    assert found is not None and found.epoch == 1
    assert "rank1.pt does not match its manifest" in caplog.text
    # Asked for by path, the damaged checkpoint is refused with the reason.
    with pytest.raises(CheckpointError, match=r"rank1\.pt does not match"):
        resolve_resume(str(store.root / "epoch-000002"), store)


def test_commit_refuses_a_checkpoint_with_a_missing_part(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    store.write_part(3, MODEL_FILE, {})
    store.write_part(3, COORDINATOR_FILE, {})
    store.write_part(3, rank_file(0), {})
    with pytest.raises(CheckpointError, match=r"parts missing: rank1\.pt"):
        store.commit(3, world_size=2)
    assert store.latest() is None


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    for epoch in range(4):
        write_checkpoint(store, epoch)
    assert sorted(p.name for p in store.root.iterdir() if p.is_dir()) == ["epoch-000002", "epoch-000003"]


def test_resume_choices(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path / "run", keep=2)
    assert resolve_resume("auto", store) is None  # a fresh run
    write_checkpoint(store, 4)
    assert resolve_resume("auto", store).epoch == 4
    assert resolve_resume("never", store) is None
    other = CheckpointDir(tmp_path / "elsewhere", keep=2)
    assert resolve_resume(str(tmp_path / "run"), other).epoch == 4  # a run dir
    assert resolve_resume(str(store.root), other).epoch == 4  # its checkpoints/ dir
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_resume(str(tmp_path / "elsewhere"), other)


def test_a_different_world_size_is_refused_with_what_to_do(tmp_path: Path) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    write_checkpoint(store, 0, world_size=2)
    with pytest.raises(CheckpointError, match=r"written by 2 rank\(s\); this job has 4.*resume=never"):
        check_world_size(store.latest(), 4)


def test_history_after_the_checkpoint_is_dropped_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"epoch": e, "loss": 1.0 / (e + 1)}) + "\n" for e in range(5)))
    truncate_history(path, through_epoch=2)
    assert [json.loads(line)["epoch"] for line in path.read_text().splitlines()] == [0, 1, 2]
