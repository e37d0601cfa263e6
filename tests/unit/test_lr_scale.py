"""The learning rate's scale with the number of ranks."""

from __future__ import annotations

import pytest

from flodl.worker.task_setup import lr_scale_factor


@pytest.mark.parametrize(
    ("world", "ratio", "factor"),
    [(1, 1.0, 1.0), (1, 0.5, 1.0), (4, 1.0, 4.0), (4, 0.5, 2.5), (8, 0.0, 1.0), (3, 0.25, 1.5)],
)
def test_lr_scale_factor(world, ratio, factor):
    assert lr_scale_factor(world, ratio) == pytest.approx(factor)
