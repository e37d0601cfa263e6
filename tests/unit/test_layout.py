"""The world a run is laid out for (flodl/config/layout.py): built once with the choice of checkpoint,
recorded once in each checkpoint (the coordinator's state), kept on resume under keep_global_batch; a
checkpoint of an older flodl (`step_samples` and `layout_step` in the coordinator's state, `layout_step` and
`lr_world` in each rank's part) resumes as it did."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flodl.checkpoints.disk import (
    COORDINATOR_FILE,
    MODEL_FILE,
    CheckpointDir,
    CheckpointError,
    Point,
    rank_file,
)
from flodl.config.layout import Layout
from flodl.coordinator.commit import CheckpointCommitter, run_kind
from flodl.coordinator.ledger import EpochLedger
from flodl.job.resume import ResumeSettings, _checked_choice
from flodl.links.messages import ChunkReport
from flodl.worker.lr_world import LrWorld
from flodl.worker.task_setup import lr_scale_factor

SYNC = run_kind("sync", False)
RUN = {"uid": "u"}


def _settings(store: CheckpointDir, batch_size: int, step: int, keep: bool = True) -> ResumeSettings:
    return ResumeSettings("auto", store, SYNC, RUN, store.root / "metrics.jsonl", batch_size, step, keep)


def _commit(committer: CheckpointCommitter, members: list[int]) -> dict:
    """Epoch 0's checkpoint with the parts of `members` (the others cut before it); its coordinator state."""
    ledger = EpochLedger(epochs=2, world_size=committer.world_size, batches_per_epoch=len(members))
    for rank in members:
        ledger.add_chunk(ChunkReport(rank, 0, 1, 32, 1.0, 10.0, 1.0))
    ledger.expect_eval(0, False)
    assert len(ledger.emit_ready()) == 1
    committer.expect_parts(Point(0), members, {})
    committer.store.write_part(Point(0), MODEL_FILE, {})
    for rank in members:
        committer.store.write_part(Point(0), rank_file(rank), {"worker": {"lr_world": len(members)}})
        committer.on_saved(Point(0), rank, 1, ledger)
    (checkpoint,) = committer.poll(ledger, wait_sealed=True)
    committer.close()
    return checkpoint.load(COORDINATOR_FILE)


def test_a_checkpoint_taken_after_a_cut_that_kept_the_global_batch_resumes_with_that_batch(
    tmp_path: Path,
) -> None:
    """keep_global_batch: 4 ranks laid out at steps of 24 (a global batch of 96 in micro-batches of 8); a cut
    left 3 members stepping 32 each (the same 96), and a checkpoint of their 3 parts. Resumed on 3 ranks it
    keeps the 96, 4 micro-batches a step (the layout derived from the members' count and the configured
    step made it 3 x 24 = 72)."""
    store = CheckpointDir(tmp_path, keep=2)
    committer = CheckpointCommitter(store, 4, {0}, SYNC, RUN, Layout(4, 24, kept=True))
    state = _commit(committer, [0, 1, 2])
    assert state["layout"] == {"world": 4, "step": 24, "kept": True}  # once, in the coordinator's state
    assert "layout_step" not in state and "step_samples" not in state
    found, layout = _checked_choice(_settings(store, 8, 24), 3)
    assert found is not None and found.part_ranks == (0, 1, 2)
    assert layout == Layout(4, 24, kept=True) and layout.member_step(3, 8) == 32


def test_a_run_whose_batch_follows_the_world_records_its_members_layout(tmp_path: Path) -> None:
    """Without keep_global_batch the global batch follows the members: a checkpoint of 3 members' parts is
    laid out for 3 ranks, which a later resume with keep_global_batch keeps (on 3 ranks: as configured)."""
    store = CheckpointDir(tmp_path, keep=2)
    state = _commit(CheckpointCommitter(store, 4, {0}, SYNC, RUN, Layout(4, 24)), [0, 1, 2])
    assert state["layout"] == {"world": 3, "step": 24, "kept": False}
    assert _checked_choice(_settings(store, 8, 24), 3)[1] == Layout(3, 24, kept=True)
    assert _checked_choice(_settings(store, 8, 24, keep=False), 2)[1] == Layout(2, 24)  # this world's


def _old_checkpoint(store: CheckpointDir, coordinator: dict, parts: int, lr_world: int) -> None:
    """A checkpoint as the flodl before the layout wrote it: the layout's step in both its states."""
    point = Point(0)
    store.write_part(point, MODEL_FILE, {})
    store.write_part(point, COORDINATOR_FILE, {**SYNC, **coordinator, "epoch": 0, "into": None})
    for rank in range(parts):
        part = {
            "worker": {"global_samples": 0, "lr_world": lr_world, "layout_step": coordinator["layout_step"]}
        }
        store.write_part(point, rank_file(rank), part)
    store.commit(point, parts, RUN)


def _lr_world(layout: Layout, step: int, world: int, saved: int) -> tuple[LrWorld, torch.optim.Optimizer]:
    """A sync rank's learning-rate world on `world` ranks stepping `step`, its optimizer restored from a part
    whose learning rate was scaled for `saved` ranks (lr 0.1, lr_scale_ratio=1)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1 * lr_scale_factor(saved, 1.0))
    stepper = SimpleNamespace(step_samples=step, parts=SimpleNamespace(optimizer=optimizer, scheduler=None))
    return LrWorld(stepper, world, 1.0, layout), optimizer  # type: ignore[arg-type]


@pytest.mark.parametrize(("keep", "accum", "lr"), [(True, 4, 0.1 * 4), (False, 2, 0.1 * 1)])
def test_an_old_format_checkpoint_resumes_with_its_global_batch_and_learning_rate(
    tmp_path: Path, keep: bool, accum: int, lr: float
) -> None:
    """2 ranks' checkpoint of steps of 16 (2 micro-batches of 8) of a run first laid out for 4 ranks of 8,
    its learning rate scaled for that world of 4 (lr_scale_ratio=1). Resumed on 1 rank: with
    keep_global_batch the 32 stay (4 micro-batches, the learning rate still that of 4 ranks' batch), without
    the batch follows the world (the learning rate that of 1 rank)."""
    store = CheckpointDir(tmp_path, keep=2)
    _old_checkpoint(store, {"step_samples": 16, "layout_step": 8}, parts=2, lr_world=4)
    found, layout = _checked_choice(_settings(store, 8, 16, keep), 1)
    assert found is not None and layout.global_batch // 8 == accum
    part = found.load(rank_file(0))["worker"]
    lr_world, optimizer = _lr_world(layout, layout.global_batch, 1, part["lr_world"])  # 1 rank: the batch
    lr_world.restore(part, 1)
    lr_world.scale_to(1, say=False)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr)
    assert lr_world.state() == {"lr_world": 4 if keep else 1}  # the layout is not the part's to record


def test_an_old_format_checkpoint_that_keeps_no_whole_batch_is_refused_naming_the_fitting_worlds(
    tmp_path: Path,
) -> None:
    store = CheckpointDir(tmp_path, keep=2)
    _old_checkpoint(store, {"step_samples": 32, "layout_step": None}, parts=3, lr_world=3)
    with pytest.raises(CheckpointError, match=r"global batch of 96 \(3 ranks\).*resume on 1 or 3 ranks"):
        _checked_choice(_settings(store, 32, 32), 2)


def test_a_layout_recorded_at_any_membership_comes_back_as_the_run_laid_it_out() -> None:
    rng = random.Random(56)
    for _ in range(500):
        layout = Layout(rng.randint(1, 8), 8 * rng.randint(1, 4), rng.random() < 0.5)
        members, configured = rng.randint(1, 8), 8 * rng.randint(1, 4)
        recorded = {"layout": layout.at(members).state()}
        back = Layout.saved(recorded, members, configured, layout.kept)
        assert back == (layout if layout.kept else Layout(members, layout.step))
        assert Layout.from_state(layout.state()) == layout  # as the host publishes it to the ranks
