"""A checkpoint resumes on another number of gloo ranks (flodl/job/resize.py): 2 ranks' checkpoint inside an
epoch resumed on 3, and that run's checkpoint inside a later epoch on 2, trains every sample of every epoch
exactly once across both resizes (counted from the reads of a Dataset that logs them) under sync, cadence and
async; the run says what it resized, and under sync the learning rate follows the world. With
keep_global_batch, 2 ranks' checkpoint resumed on 1 (two micro-batches a step) keeps the run's global steps
and ends within float tolerance of the uninterrupted 2-rank run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers.procs import FAST_START, train
from tests.helpers.resize_counts import (
    CONF,
    PINNED,
    SAMPLES,
    read,
    resumable,
    resumed_trains_each_sample_once_an_epoch,
)
from tests.helpers.resize_counts import POINTS as BYO_POINTS
from tests.helpers.runs import epochs_of

pytestmark = pytest.mark.multiproc

POINTS = (*BYO_POINTS, "epochs=4")


@pytest.mark.parametrize(
    ("policy", "every"),
    [
        ("sync", ("checkpoint_every_steps=5",)),
        ("cadence", (*PINNED, "checkpoint_every_steps=4")),
        ("async", (*PINNED, "max_overshoot=1", "checkpoint_every_steps=4")),
    ],
)
def test_a_checkpoint_resumes_on_more_ranks_and_then_on_fewer_every_sample_once_an_epoch(
    tmp_path: Path, policy: str, every: tuple[str, ...]
) -> None:
    # One log dir for every run (the task's config is the checkpoint's), moved aside after each.
    common = [*POINTS, f"policy={policy}", *every, f"task.train_data.log={tmp_path / 'reads'}"]
    logs = {name: tmp_path / f"reads-{name}" for name in ("two", "three", "back")}

    def run(name: str, ranks: int, *more: str) -> str:
        ranks_and_dir = (f"launch.nproc_per_node={ranks}", f"hydra.run.dir={tmp_path / name}")
        result = train(*common, *ranks_and_dir, *more, cwd=tmp_path, timeout=240).check()
        (tmp_path / "reads").rename(logs[name])
        return result.out

    run("two", 2)
    assert read(logs["two"]) == Counter({i: 4 for i in range(SAMPLES)})  # uninterrupted: once an epoch
    grown_from = resumable(tmp_path / "two", 3)
    out = run("three", 3, f"resume={grown_from}", "checkpoint_every_steps=2")
    assert "resumed 2 ranks' checkpoint on 3; rank 2 starts with" in out
    resumed_trains_each_sample_once_an_epoch(grown_from, logs["three"], 4)
    shrunk_from = resumable(tmp_path / "three", 4)
    out = run("back", 2, f"resume={shrunk_from}")
    assert "resumed 3 ranks' checkpoint on 2; the part of rank 2 is left" in out
    resumed_trains_each_sample_once_an_epoch(shrunk_from, logs["back"], 4)
    # Each run dir's records: the epochs it trained (of the resumed one, the whole epoch's record).
    grown, records = epochs_of(tmp_path / "three"), epochs_of(tmp_path / "back")
    assert [(r["epoch"], r["world"]) for r in grown + records] == [(2, 3), (3, 3), (3, 2)]
    if policy == "sync":  # lr_scale_ratio=1: the learning rate follows the world, x n for n ranks
        assert [round(r["lr"], 6) for r in grown + records] == [0.3, 0.3, 0.2]


KEEP_GLOBAL = (*POINTS, "task.train_data.noise=0", "keep_global_batch=true")
CHECKPOINTED = (*KEEP_GLOBAL, "checkpoint_every_steps=5")


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-rank run with keep_global_batch, a checkpoint every 5 steps: what a resume on 1
    rank and a death under survive (the same run, undisturbed) end within float tolerance of."""
    run_dir = tmp_path_factory.mktemp("keep-global") / "whole"
    ran = (*CHECKPOINTED, "launch.nproc_per_node=2", f"hydra.run.dir={run_dir}")
    train(*ran, cwd=run_dir.parent, timeout=240).check()
    return run_dir


def test_keep_global_batch_resumes_two_ranks_checkpoint_on_one_within_float_tolerance_of_the_whole_run(
    tmp_path: Path, whole: Path
) -> None:
    resumed = tmp_path / "resumed"
    again = (f"resume={resumable(whole, 2)}", f"hydra.run.dir={resumed}")
    out = train(*CHECKPOINTED, "launch.nproc_per_node=1", *again, cwd=tmp_path, timeout=240).check().out
    assert "grad_accum 2 (configured 1) keeps the checkpoint's global batch" in out
    # The start line says the learning rate the optimizer has: the 2 ranks' global batch's, not 1 rank's.
    assert "world=1 batch=16 x grad_accum 2/rank (global 32) lr x2 (lr_scale_ratio=1)" in out
    a = torch.load(whole / "model.pt", weights_only=True)
    b = torch.load(resumed / "model.pt", weights_only=True)
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)
    ran, again_records = epochs_of(whole), epochs_of(resumed)
    # The epochs from the resumed one on: the learning rate the 2 ranks had, their losses.
    assert [(r["epoch"], r["world"]) for r in again_records] == [(1, 1), (2, 1), (3, 1)]
    assert [r["lr"] for r in again_records] == [r["lr"] for r in ran[1:]]
    assert [round(r["loss"], 5) for r in again_records] == [round(r["loss"], 5) for r in ran[1:]]


def test_keep_global_batch_under_survive_a_death_leaves_the_trajectory_of_the_undisturbed_run(
    tmp_path: Path, whole: Path
) -> None:
    """sync, 2 ranks, survive: rank 1 dies inside the third epoch and is not restarted; rank 0 takes its
    share of each step by gradient accumulation (two micro-batches), so the global batch and the learning
    rate stay, and the run ends within float tolerance of the same run without a death."""
    common = [
        *KEEP_GLOBAL,
        "launch.nproc_per_node=2",
        "fault_tolerance=survive",
        "min_ranks=1",
        "launch.max_restarts=0",
    ]
    survived = tmp_path / "survived"
    death = ("simulate.kill_rank=1", "simulate.kill_at_step=15", f"hydra.run.dir={survived}")
    out = train(*common, *death, cwd=tmp_path, timeout=240).check().out
    assert "keep_global_batch: 1 members keep the global step of 32, 32 samples each" in out
    a = torch.load(whole / "model.pt", weights_only=True)
    b = torch.load(survived / "model.pt", weights_only=True)
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)
    ran, records = epochs_of(whole), epochs_of(survived)
    assert [r["world"] for r in records] == [2, 2, 1, 1] and [r["lr"] for r in records] == [
        r["lr"] for r in ran
    ]


def test_a_stream_resumed_on_another_world_is_refused_saying_what_would_be_lost(tmp_path: Path) -> None:
    stream = ("--config-dir", CONF, "task=byo_stream", "steps_per_epoch=4", "epochs=2", FAST_START)
    saved, items = tmp_path / "saved", tmp_path / "items"  # the stream's loss logs the items it trains there
    items.mkdir()
    logged = {"FLODL_TEST_DRAW_DIR": str(items)}
    train(
        *stream, "launch.nproc_per_node=2", f"hydra.run.dir={saved}", cwd=tmp_path, timeout=240, **logged
    ).check()
    checkpoint = saved / "checkpoints" / "epoch-000001"
    again = (f"resume={checkpoint}", f"hydra.run.dir={tmp_path / 'again'}")
    refused = train(*stream, "launch.nproc_per_node=3", *again, cwd=tmp_path, timeout=240, **logged)
    assert refused.code != 0 and not (tmp_path / "again" / "model.pt").exists(), refused.out
    assert "task.train_data is a stream" in refused.out and "resume with 2 ranks" in refused.out, refused.out
