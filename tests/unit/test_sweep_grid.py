"""A multirun's whole grid checked before its first job trains (hydra_plugins/flodl_sweeper)."""

from __future__ import annotations

from flodl.config.sweep import CheckedJob, grid_batches


def test_batches_keep_each_jobs_place_in_the_grid() -> None:
    """A launcher numbers a batch's jobs on from the number it is given: every batch is a run of jobs next
    to each other in the grid, started at the first one's place, so an invalid job's number stays unused."""
    checked = [CheckedJob(i, [f"seed={i}"], ["bad"] if i in (0, 3, 4) else []) for i in range(9)]
    assert [(first, [j.job for j in jobs]) for first, jobs in grid_batches(checked, None)] == [
        (1, [1, 2]),
        (5, [5, 6, 7, 8]),
    ]
    assert [(first, [j.job for j in jobs]) for first, jobs in grid_batches(checked, 3)] == [
        (1, [1, 2]),
        (5, [5, 6, 7]),
        (8, [8]),
    ]
