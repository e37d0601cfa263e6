"""Which epochs end with an evaluation."""

from __future__ import annotations

import pytest

from flodl.coordinator.driver import EpochSchedule


def schedule(eval_every: int, epochs: int = 10, has_eval: bool = True) -> EpochSchedule:
    return EpochSchedule(
        epochs=epochs, world_size=2, total_picks=100, batch_size=8, eval_every=eval_every, has_eval=has_eval
    )


@pytest.mark.parametrize(
    ("eval_every", "expected"),
    [(0, []), (1, list(range(10))), (3, [2, 5, 8, 9]), (5, [4, 9]), (20, [9])],
)
def test_evaluates_after(eval_every, expected):
    sched = schedule(eval_every)
    assert [e for e in range(10) if sched.evaluates_after(e)] == expected


def test_no_eval_data_never_evaluates():
    sched = schedule(1, has_eval=False)
    assert not any(sched.evaluates_after(e) for e in range(10))
