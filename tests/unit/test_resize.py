"""What a checkpoint resumed on another number of ranks gives each rank, and the batch it keeps (pure)."""

from __future__ import annotations

import pytest

from flodl.config.schema import to_config
from flodl.job.resize import (
    Resize,
    grad_accum_for,
    keep_batch_problem,
    layout_step,
    lr_world_of,
    stream_problem,
)


def test_each_rank_restores_its_own_part_or_the_one_the_rule_names() -> None:
    grown = Resize(saved_world=2, parts=(0, 1), world=5, shares_optimizer=False)
    assert [grown.owns(r) for r in range(5)] == [True, True, False, False, False]
    assert [grown.source(r) for r in range(5)] == [0, 1, 0, 1, 0]  # by index: r mod the saved parts
    synced = Resize(saved_world=2, parts=(0, 1), world=5, shares_optimizer=True)
    assert [synced.source(r) for r in range(5)] == [0, 1, 0, 0, 0]  # one optimizer state: the first part's
    # A member cut at the checkpoint round left no part: the rule reads the parts there are.
    cut = Resize(saved_world=3, parts=(0, 2), world=3, shares_optimizer=False)
    assert [cut.source(r) for r in range(3)] == [0, 2, 2] and not cut.changed


def test_the_resize_says_what_each_rank_starts_from_and_what_is_left() -> None:
    grown = Resize(saved_world=2, parts=(0, 1), world=3, shares_optimizer=False).words()
    assert (
        grown == "resumed 2 ranks' checkpoint on 3; rank 2 starts with saved rank (r mod 2)'s optimizer state"
    )
    shrunk = Resize(saved_world=4, parts=(0, 1, 2, 3), world=2, shares_optimizer=True).words()
    assert (
        shrunk
        == "resumed 4 ranks' checkpoint on 2; the parts of ranks 2, 3 are left (RNG streams and counters)"
    )


@pytest.mark.parametrize(
    ("batch", "world", "size", "accum"),
    [(64, 2, 32, 1), (64, 1, 32, 2), (128, 2, 16, 4), (96, 2, 32, None), (96, 3, 32, 1), (32, 2, 32, None)],
)
def test_keep_global_batch_needs_whole_micro_batches_on_every_rank(
    batch: int, world: int, size: int, accum: int | None
) -> None:
    assert grad_accum_for(batch, world, size) == accum


def test_a_batch_that_does_not_divide_is_refused_naming_the_worlds_that_fit() -> None:
    assert keep_batch_problem(64, 2, 1, 32) is None
    problem = keep_batch_problem(96, 3, 2, 32)
    assert problem is not None and problem.startswith("keep_global_batch=true: the checkpoint's global batch")
    assert "resume on 1 or 3 ranks" in problem and "keep_global_batch=false" in problem


def test_the_layout_step_is_the_first_runs_and_travels_with_each_checkpoint() -> None:
    assert (
        layout_step(False, {"step_samples": 32, "layout_step": 16}, 32) is None
    )  # the batch follows the world
    assert layout_step(True, None, 32) == 32  # a fresh run is laid out as it steps
    assert layout_step(True, {"step_samples": 32}, 64) == 32  # a checkpoint from before keep_global_batch
    assert layout_step(True, {"step_samples": 32, "layout_step": 16}, 64) == 16  # resized before: its first


@pytest.mark.parametrize(("keep", "lr_world"), [(True, 2), (False, 1)])
def test_the_learning_rate_keeps_the_world_of_the_global_batch_it_keeps(keep: bool, lr_world: int) -> None:
    task = {"name": "t", "model": "m", "train_data": "d", "loss": "l", "optimizer": "o"}
    # 2 ranks' checkpoint of steps of 16, resumed on 1 rank of two micro-batches of 16 (keep_global_batch).
    cfg = to_config({"task": task, "batch_size": 16, "grad_accum": 2, "keep_global_batch": keep})
    assert lr_world_of(cfg, {"step_samples": 16, "layout_step": 16}, 1) == lr_world
    assert lr_world_of(cfg, None, 3) == 3  # a fresh run: its own world


def test_a_stream_resumes_only_on_its_own_world() -> None:
    assert stream_problem(2, 2) is None
    problem = stream_problem(2, 3)
    assert (
        problem is not None and "task.train_data is a stream" in problem and "resume with 2 ranks" in problem
    )
