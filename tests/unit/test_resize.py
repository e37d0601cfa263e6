"""What a checkpoint resumed on another number of ranks gives each rank, and the batch it keeps (pure)."""

from __future__ import annotations

import pytest

from flodl.config.layout import Layout
from flodl.job.resize import Resize, grad_accum_for, keep_batch_problem, resumed_layout, stream_problem


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
    assert grad_accum_for(Layout(1, batch, kept=True), world, size) == accum


def test_a_batch_that_does_not_divide_is_refused_naming_the_worlds_that_fit() -> None:
    assert keep_batch_problem(Layout(2, 32, kept=True), 1, 32) is None
    problem = keep_batch_problem(Layout(3, 32, kept=True), 2, 32)
    assert problem is not None and problem.startswith(
        "keep_global_batch=true: the checkpoint's global batch of 96 (3 ranks)"
    )
    assert "resume on 1 or 3 ranks" in problem and "keep_global_batch=false" in problem


def test_the_layout_is_the_first_runs_and_travels_with_each_checkpoint() -> None:
    kept, follows = Layout(1, 64, kept=True), Layout(1, 64)
    saved = {"layout": Layout(4, 16, kept=True).state()}
    assert resumed_layout(follows, saved, 2) == follows  # the batch follows the world
    assert resumed_layout(kept, None, 0) == kept  # a fresh run is laid out as it steps, on its world
    assert resumed_layout(kept, saved, 2) == Layout(4, 16, kept=True)  # resized before: its first world
    # A checkpoint of an older flodl: its members' steps (of `step_samples`) in steps of `layout_step`.
    assert resumed_layout(kept, {"step_samples": 32}, 2) == Layout(2, 32, kept=True)
    assert resumed_layout(kept, {"step_samples": 32, "layout_step": 16}, 2) == Layout(4, 16, kept=True)
    assert resumed_layout(kept, {}, 2) == Layout(2, 64, kept=True)  # before step_samples: as configured now


@pytest.mark.parametrize(("keep", "lr_world"), [(True, 2), (False, 1)])
def test_the_learning_rate_keeps_the_world_of_the_global_batch_it_keeps(keep: bool, lr_world: int) -> None:
    # 2 ranks' checkpoint of steps of 16, resumed on 1 rank of two micro-batches of 16 (keep_global_batch).
    layout = resumed_layout(Layout(1, 32, keep), {"layout": Layout(2, 16).state()}, 2)
    assert layout.world_of(1, 32) == lr_world
    assert Layout(3, 32, keep).world_of(3, 32) == 3  # a fresh run: its own world


def test_a_stream_resumes_only_on_its_own_world() -> None:
    assert stream_problem(2, 2) is None
    problem = stream_problem(2, 3)
    assert (
        problem is not None and "task.train_data is a stream" in problem and "resume with 2 ranks" in problem
    )
