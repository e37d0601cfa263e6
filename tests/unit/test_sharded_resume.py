"""Which checkpoint a run of sharded groups resumes, checked before any rank starts (flodl/job/resume.py):
a checkpoint of full replicas is refused with one line saying what to do; one of sharded groups is taken on
any layout. The manifest vouches for the sharded files, and a checkpoint holding its model in shards has no
model.pt to miss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flodl.checkpoints.disk import (
    COORDINATOR_FILE,
    MODEL_FILE,
    Checkpoint,
    CheckpointDir,
    CheckpointError,
    Point,
    rank_file,
)
from flodl.checkpoints.sharded import SHARDED_DIR
from flodl.coordinator.commit import run_kind
from flodl.job.resume import ResumeSettings, choose_checkpoint

CADENCE = run_kind("cadence", True)
RUN = {"uid": "u"}


def _checkpoint(tmp_path: Path, sharded: bool) -> CheckpointDir:
    """A committed checkpoint of 2 ranks after epoch 0: a replicas' (model.pt) or sharded groups' (its model
    in the sharded dir)."""
    store = CheckpointDir(tmp_path, keep=2)
    point = Point(0)
    if sharded:
        (store.partial(point) / SHARDED_DIR).mkdir()
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
            (store.partial(point) / SHARDED_DIR / name).write_bytes(b"shard")
    else:
        store.write_part(point, MODEL_FILE, {"w": torch.zeros(2)})
    store.write_part(point, COORDINATOR_FILE, CADENCE)
    for rank in range(2):
        store.write_part(point, rank_file(rank), {})
    store.commit(point, world_size=2, run=RUN)
    return store


def _settings(store: CheckpointDir, sharded: bool) -> ResumeSettings:
    return ResumeSettings("auto", store, CADENCE, RUN, store.root / "metrics.jsonl", sharded=sharded)


def test_a_checkpoint_of_full_replicas_is_refused_by_sharded_groups_naming_shard_group(
    tmp_path: Path,
) -> None:
    store = _checkpoint(tmp_path, sharded=False)
    assert choose_checkpoint(_settings(store, sharded=False), 3) is not None
    with pytest.raises(CheckpointError, match="written by full replicas") as refused:
        choose_checkpoint(_settings(store, sharded=True), 4)
    assert "resume it with shard_group=1, or start fresh with resume=never" in str(refused.value)


@pytest.mark.parametrize("sharded_run", [True, False])
def test_a_checkpoint_of_sharded_groups_resumes_on_any_layout(tmp_path: Path, sharded_run: bool) -> None:
    store = _checkpoint(tmp_path, sharded=True)
    found = choose_checkpoint(_settings(store, sharded=sharded_run), 3)
    assert found is not None and found.sharded
    assert not (found.path / MODEL_FILE).exists()
    # The manifest fingerprints the shards: a damaged one is found, and the checkpoint skipped.
    (found.path / SHARDED_DIR / "__1_0.distcp").write_bytes(b"torn")
    assert store.latest() is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # its save, in one process
def test_a_sharded_checkpoints_model_is_read_whole_without_a_process_group(tmp_path: Path) -> None:
    # What the run's host writes as model.pt when the checkpoint covers every epoch, and what each rank loads
    # before sharding its model: the "model" entries of the sharded dir, whole (the optimizer's are not).
    import torch.distributed.checkpoint as dcp

    model = {"net.0.weight": torch.randn(4, 3), "net.0.bias": torch.randn(4)}
    state = {"model": model, "optimizer_of_group_0": {"state": {"net.0.weight": torch.ones(4, 3)}}}
    path = tmp_path / "checkpoints" / "epoch-000001" / SHARDED_DIR
    dcp.save(state, checkpoint_id=path, no_dist=True)
    read = Checkpoint(path.parent, 0, 2).model()
    assert read.keys() == model.keys()
    assert all(torch.equal(read[key], model[key]) for key in model)
